"""Reads Prometheus text exposition on stdin with prometheus_client's own parser (the Python
client's text-format parser, python3-prometheus-client) and checks every histogram in it:
bucket bounds ascending and ending in +Inf, cumulative counts never falling, the +Inf bucket
equal to _count, and _sum not negative. Prints JSON for the caller to assert on:
  {"counters": {name: value}, "gauges": {name: value}, "histograms": {name: {labels: {"count": n, "sum": s,
   "buckets": [[le, cumulative], ...]}}}}
where `labels` is the series' labels other than le, as "k=v,k=v" (empty when none).
Exits 1, naming the series, on the first inconsistency; 2 when the text does not parse."""
import json
import math
import sys

from prometheus_client.parser import text_string_to_metric_families


def fail(message):
    print(message, file=sys.stderr)
    sys.exit(1)


def main():
    text = sys.stdin.read()
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as e:  # the parser's own complaint
        print(f"does not parse: {e}", file=sys.stderr)
        sys.exit(2)
    out = {"counters": {}, "gauges": {}, "histograms": {}}
    for family in families:
        if family.type in ("counter", "gauge"):
            for s in family.samples:
                out[family.type + "s"][s.name] = s.value
        if family.type != "histogram":
            continue
        series = {}
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            entry = series.setdefault(labels, {"buckets": [], "count": None, "sum": None})
            if s.name == family.name + "_bucket":
                entry["buckets"].append([float(s.labels["le"]), s.value])
            elif s.name == family.name + "_count":
                entry["count"] = s.value
            elif s.name == family.name + "_sum":
                entry["sum"] = s.value
            else:
                fail(f"{family.name}: unexpected sample {s.name}")
        if not series:
            fail(f"{family.name}: a histogram with no series")
        for labels, e in series.items():
            where = f"{family.name}{{{labels}}}"
            b = e["buckets"]
            if not b or not math.isinf(b[-1][0]):
                fail(f"{where}: no +Inf bucket")
            if any(b[i][0] >= b[i + 1][0] for i in range(len(b) - 1)):
                fail(f"{where}: bucket bounds not ascending")
            if any(b[i][1] > b[i + 1][1] for i in range(len(b) - 1)):
                fail(f"{where}: cumulative counts fall")
            if e["count"] is None or e["sum"] is None:
                fail(f"{where}: _count or _sum missing")
            if b[-1][1] != e["count"]:
                fail(f"{where}: +Inf bucket {b[-1][1]} but _count {e['count']}")
            if e["sum"] < 0 or (e["count"] == 0 and e["sum"] != 0):
                fail(f"{where}: _sum {e['sum']} with _count {e['count']}")
            e["buckets"] = [[("+Inf" if math.isinf(le) else le), n] for le, n in b]
        out["histograms"][family.name] = series
    print(json.dumps(out))


main()
