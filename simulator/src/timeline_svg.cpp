// The sequence-diagram renderer behind timeline_svg: layout first (lanes, instants, bars),
// then one pass that writes the SVG.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <deque>
#include <map>
#include <set>

#include "idem/sim/timeline.hpp"

namespace idem::sim {

std::string_view to_string(Mark mark) {
  switch (mark) {
    case Mark::send:
      return "send";
    case Mark::reserve:
      return "reserve";
    case Mark::wait:
      return "wait";
    case Mark::wake:
      return "wake";
    case Mark::charge:
      return "charge";
    case Mark::complete:
      return "complete";
    case Mark::replay:
      return "replay";
    case Mark::conflict:
      return "conflict";
    case Mark::reuse:
      return "reuse";
    case Mark::release:
      return "release";
    case Mark::error:
      return "error";
    case Mark::crash:
      return "crash";
    case Mark::takeover:
      return "takeover";
    case Mark::lease_lost:
      return "lease_lost";
    case Mark::pause:
      return "pause";
    case Mark::note:
      return "note";
    case Mark::answer:
      return "answer";
  }
  return "note";
}

namespace {

// Sizes in px.
constexpr double kAxisX = 64;          // the time axis; tick labels to its left
constexpr double kTop = 16;            // above the figure title
constexpr double kRow = 17;            // one stacked event
constexpr double kMinGap = 42;         // the shortest gap between instants, when it fits
constexpr double kMaxGap = 230;        // a longer quiet gap is shortened and drawn broken
constexpr double kProportional = 560;  // the most height proportional time may take
constexpr double kSubtrack = 11;       // offset of a bar overlapping another on one lane
constexpr double kPanelGap = 14;       // between panels
constexpr double kLabelFont = 11;      // labels
constexpr double kCharWidth = 0.53;    // estimated glyph width, in em (generous: no overlap)
constexpr const char* kFont = "sans-serif";

// An estimate of the drawn width of `text` (UTF-8) at `px`: no font metrics without a
// font; the estimate is generous so labels do not run into the next lane.
double text_width(std::string_view text, double px) {
  std::size_t glyphs = 0;
  for (char c : text)
    if ((static_cast<unsigned char>(c) & 0xC0) != 0x80) ++glyphs;
  return static_cast<double>(glyphs) * px * kCharWidth;
}

// Text as XML character data or attribute value: the five special characters become
// entities, and control characters XML 1.0 forbids become '?'.
std::string escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r') {
          out += '?';
        } else {
          out += c;
        }
    }
  }
  return out;
}

// A number as SVG wants it: at most one decimal, no trailing ".0", never "-0".
std::string num(double v) {
  const long long tenths = static_cast<long long>(v * 10 + (v < 0 ? -0.5 : 0.5));
  if (tenths % 10 == 0) return fmt::format("{}", tenths / 10);
  return fmt::format("{}{}.{}", tenths < 0 ? "-" : "", std::abs(tenths) / 10,
                     std::abs(tenths) % 10);
}

std::string ms_label(long long ms) { return fmt::format("{} ms", ms); }

// Each mark's shape, centred on (0, 0).
std::string shape(Mark mark) {
  switch (mark) {
    case Mark::send:
      return R"(<circle r="4" fill="#6b7280"/>)";
    case Mark::reserve:
      return R"(<rect x="-5" y="-5" width="10" height="10" fill="#1d4ed8" stroke="#ffffff"/>)";
    case Mark::takeover:
      return R"(<path d="M-6,-6 L6,0 L-6,6 Z" fill="#1d4ed8" stroke="#ffffff"/>)";
    case Mark::wait:
      return R"(<circle r="5" fill="#ffffff" stroke="#d97706" stroke-width="2"/>)";
    case Mark::wake:
      return R"(<circle r="5" fill="#d97706"/>)";
    case Mark::charge:
      return R"(<circle r="8" fill="#dc2626"/>)"
             R"(<text y="4" text-anchor="middle" font-family="sans-serif" font-size="11" )"
             R"(font-weight="bold" fill="#ffffff">$</text>)";
    case Mark::complete:
      return R"(<circle r="6" fill="#15803d"/>)"
             R"(<path d="M-3,0 L-1,3 L3.5,-3" fill="none" stroke="#ffffff" stroke-width="1.8"/>)";
    case Mark::replay:
      return R"(<path d="M0,-6 L6,0 L0,6 L-6,0 Z" fill="#0e7490"/>)";
    case Mark::conflict:
      return R"(<path d="M0,-6 L6,5 L-6,5 Z" fill="#ea580c"/>)";
    case Mark::reuse:
      return R"(<path d="M0,-6 L6,5 L-6,5 Z" fill="#9333ea"/>)";
    case Mark::release:
      return R"(<rect x="-5" y="-5" width="10" height="10" fill="#ffffff" stroke="#1d4ed8" )"
             R"(stroke-width="2"/>)";
    case Mark::error:
      return R"(<path d="M-5,-5 L5,5 M5,-5 L-5,5" stroke="#b91c1c" stroke-width="2.5"/>)";
    case Mark::lease_lost:
      return R"(<rect x="-5" y="-5" width="10" height="10" fill="#ffffff" stroke="#b91c1c" )"
             R"(stroke-width="2"/><path d="M-5,5 L5,-5" stroke="#b91c1c" stroke-width="2"/>)";
    case Mark::pause:
      return R"(<rect x="-6" y="-6" width="12" height="12" rx="2" fill="#4b5563"/>)"
             R"(<path d="M-2.2,-3.5 L-2.2,3.5 M2.2,-3.5 L2.2,3.5" stroke="#ffffff" )"
             R"(stroke-width="2"/>)";
    case Mark::crash:
      return R"(<circle r="7" fill="#111827"/>)"
             R"(<path d="M-3.5,-3.5 L3.5,3.5 M3.5,-3.5 L-3.5,3.5" stroke="#ffffff" )"
             R"(stroke-width="2"/>)";
    case Mark::note:
      return R"(<circle r="3" fill="#9ca3af"/>)";
    case Mark::answer:
      return R"(<path d="M5,-5 L-3,0 L5,5" fill="none" stroke="#374151" stroke-width="2"/>)";
  }
  return {};
}

// The legend's words for each mark.
std::string_view meaning(Mark mark) {
  switch (mark) {
    case Mark::send:
      return "sends a request";
    case Mark::reserve:
      return "reserves the key";
    case Mark::takeover:
      return "takes over an expired lease";
    case Mark::wait:
      return "waits for the holder";
    case Mark::wake:
      return "woken";
    case Mark::charge:
      return "CHARGE (money moved)";
    case Mark::complete:
      return "completes (outcome stored)";
    case Mark::replay:
      return "replays the stored outcome";
    case Mark::conflict:
      return "409 in progress";
    case Mark::reuse:
      return "422 key reuse";
    case Mark::release:
      return "releases the key";
    case Mark::error:
      return "error";
    case Mark::lease_lost:
      return "loses the key, or may not call out (lease over)";
    case Mark::pause:
      return "the process freezes (no timers, no heartbeats)";
    case Mark::crash:
      return "process dies";
    case Mark::note:
      return "other event";
    case Mark::answer:
      return "receives its answer";
  }
  return {};
}

constexpr Mark kAllMarks[] = {
    Mark::send,     Mark::reserve, Mark::takeover, Mark::wait,   Mark::wake,    Mark::charge,
    Mark::complete, Mark::replay,  Mark::conflict, Mark::reuse,  Mark::release, Mark::lease_lost,
    Mark::pause,    Mark::error,   Mark::crash,    Mark::answer, Mark::note};

bool opens_hold(Mark m) { return m == Mark::reserve || m == Mark::takeover; }
bool closes_hold(Mark m) {
  return m == Mark::complete || m == Mark::release || m == Mark::crash || m == Mark::takeover ||
         m == Mark::lease_lost;
}
bool closes_wait(Mark m) {
  return m == Mark::wake || m == Mark::replay || m == Mark::conflict || m == Mark::error;
}

// One event where it is drawn.
struct Placed {
  const TimelineEvent* event;
  std::size_t lane;
  std::size_t time;   // index into the figure's instants
  std::size_t stack;  // 0 for the first event at this instant on this lane
};

struct Bar {
  std::size_t lane;
  bool wait;  // dashed (waiting) rather than solid (holding the key)
  double y0, y1;
  std::size_t track = 0;
};

// A request open on a client's lane, from its send to its answer.
struct Span {
  std::size_t lane;
  double y0, y1;
};

struct Lane {
  std::string name;
  double x = 0;      // the lifeline
  double width = 0;  // the column
  std::size_t tracks = 1;
};

struct PanelLayout {
  const TimelinePanel* panel = nullptr;
  std::vector<Lane> lanes;
  std::vector<Placed> placed;
  std::vector<Bar> bars;
  std::vector<Span> calls;
  double x = 0, width = 0;
  std::size_t charges = 0;
};

}  // namespace

std::string timeline_svg(std::string_view title, std::span<const TimelinePanel> panels) {
  // The instants of every panel, on one axis.
  std::set<long long> instant_set;
  for (const TimelinePanel& p : panels)
    for (const TimelineEvent& e : p.events) instant_set.insert(e.at_ms);
  if (instant_set.empty()) instant_set.insert(0);
  const std::vector<long long> instants(instant_set.begin(), instant_set.end());
  auto time_index = [&instants](long long at) {
    return static_cast<std::size_t>(std::lower_bound(instants.begin(), instants.end(), at) -
                                    instants.begin());
  };

  // Lanes, and each event's place in its lane's stack.
  std::vector<PanelLayout> layouts;
  std::vector<std::size_t> rows(instants.size(), 1);  // the tallest stack at each instant
  std::set<Mark> used;
  for (const TimelinePanel& p : panels) {
    PanelLayout l;
    l.panel = &p;
    auto lane_of = [&l](const std::string& name) {
      for (std::size_t i = 0; i < l.lanes.size(); ++i)
        if (l.lanes[i].name == name) return i;
      l.lanes.push_back(Lane{name});
      return l.lanes.size() - 1;
    };
    for (const std::string& name : p.lanes) lane_of(name);
    std::vector<std::size_t> order(p.events.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&p](std::size_t a, std::size_t b) {
      return p.events[a].at_ms < p.events[b].at_ms;
    });
    std::map<std::pair<std::size_t, std::size_t>, std::size_t> depth;
    for (std::size_t i : order) {
      const TimelineEvent& e = p.events[i];
      const std::size_t lane = lane_of(e.lane);
      const std::size_t t = time_index(e.at_ms);
      const std::size_t stack = depth[{lane, t}]++;
      rows[t] = std::max(rows[t], stack + 1);
      l.placed.push_back(Placed{&e, lane, t, stack});
      used.insert(e.mark);
      if (e.mark == Mark::charge) ++l.charges;
    }
    layouts.push_back(std::move(l));
  }

  // Vertical: the header rows, then each instant below the previous one, proportional to
  // time where the stacks leave room.
  std::size_t max_caption_lines = 0;
  for (const TimelinePanel& p : panels)
    max_caption_lines = std::max<std::size_t>(max_caption_lines, p.caption.empty() ? 0 : 1);
  const double title_y = kTop + 18;
  const double panel_top = title_y + 30;
  const double panel_title_y = panel_top + 20;
  const double caption_y = panel_title_y + 17;
  const double charges_y = caption_y + 17 * static_cast<double>(max_caption_lines);
  const double lane_title_y = charges_y + 24;
  const double first_y = lane_title_y + 24;
  long long min_dt = 0;
  for (std::size_t i = 1; i < instants.size(); ++i) {
    const long long dt = instants[i] - instants[i - 1];
    if (min_dt == 0 || dt < min_dt) min_dt = dt;
  }
  double scale = min_dt > 0 ? kMinGap / static_cast<double>(min_dt) : 1;
  const double span = static_cast<double>(instants.back() - instants.front());
  if (span * scale > kProportional) scale = kProportional / span;
  std::vector<double> ys(instants.size());
  std::vector<bool> broken(instants.size(), false);  // the gap before instant i is shortened
  ys[0] = first_y;
  for (std::size_t i = 1; i < instants.size(); ++i) {
    double gap = static_cast<double>(instants[i] - instants[i - 1]) * scale;
    if (gap > kMaxGap) {
      gap = kMaxGap;
      broken[i] = true;
    }
    ys[i] = ys[i - 1] + std::max(gap, static_cast<double>(rows[i - 1]) * kRow + 10);
  }
  const double last_y = ys.back() + static_cast<double>(rows.back() - 1) * kRow;
  const double bottom_y = last_y + 22;
  auto y_of = [&ys](const Placed& p) { return ys[p.time] + static_cast<double>(p.stack) * kRow; };

  // Bars: opened and closed by marks, first in first out per lane; overlapping bars on a
  // lane take separate tracks.
  for (PanelLayout& l : layouts) {
    std::map<std::size_t, std::deque<std::size_t>> holds, waits;  // lane -> open bars
    std::map<std::size_t, std::deque<std::size_t>> calls;         // lane -> open requests
    for (const Placed& p : l.placed) {
      const Mark m = p.event->mark;
      const double y = y_of(p);
      if (m == Mark::answer && !calls[p.lane].empty()) {
        l.calls[calls[p.lane].front()].y1 = y;
        calls[p.lane].pop_front();
      }
      if (m == Mark::send) {
        calls[p.lane].push_back(l.calls.size());
        l.calls.push_back(Span{p.lane, y, bottom_y - 8});
      }
      auto close = [&](std::deque<std::size_t>& open) {
        if (open.empty()) return;
        l.bars[open.front()].y1 = y;
        open.pop_front();
      };
      if (closes_hold(m)) close(holds[p.lane]);
      if (closes_wait(m)) close(waits[p.lane]);
      if (opens_hold(m)) {
        holds[p.lane].push_back(l.bars.size());
        l.bars.push_back(Bar{p.lane, false, y, bottom_y - 8});
      }
      if (m == Mark::wait) {
        waits[p.lane].push_back(l.bars.size());
        l.bars.push_back(Bar{p.lane, true, y, bottom_y - 8});
      }
    }
    std::map<std::size_t, std::vector<double>> track_end;  // lane -> each track's lowest y
    for (Bar& b : l.bars) {
      b.y1 = std::max(b.y1, b.y0 + 6);
      std::vector<double>& ends = track_end[b.lane];
      std::size_t t = 0;
      while (t < ends.size() && ends[t] > b.y0 + 0.5) ++t;
      if (t == ends.size()) ends.push_back(0);
      ends[t] = b.y1;
      b.track = t;
      l.lanes[b.lane].tracks = std::max(l.lanes[b.lane].tracks, t + 1);
    }
  }

  // Horizontal: each lane as wide as its longest label; panels side by side.
  double x = kAxisX + 12;
  for (PanelLayout& l : layouts) {
    l.x = x;
    std::vector<double> label_w(l.lanes.size(), 0);
    for (const Placed& p : l.placed) {
      const double bold = p.event->mark == Mark::charge ? 1.1 : 1.0;
      label_w[p.lane] = std::max(label_w[p.lane], text_width(p.event->text, kLabelFont) * bold);
    }
    double cx = x + 12;
    for (std::size_t i = 0; i < l.lanes.size(); ++i) {
      Lane& lane = l.lanes[i];
      const double left = 10 + static_cast<double>(lane.tracks - 1) * kSubtrack;
      const double head = text_width(lane.name, 12) * 1.1 + 10;
      lane.width = std::max(left + 10 + label_w[i] + 9, left + head);
      lane.width = std::max(lane.width, 56.0);
      lane.x = cx + left;
      cx += lane.width;
    }
    const double heading =
        std::max(text_width(l.panel->title, 14) * 1.1, text_width(l.panel->caption, kLabelFont));
    l.width = std::max(cx - x + 12, heading + 24);
    x += l.width + kPanelGap;
  }
  double width = std::max(x + 6, text_width(title, 17) * 1.1 + 2 * kAxisX);

  // The legend: what is drawn, wrapped to the width.
  struct Item {
    std::string swatch;  // drawn at (0, 0)
    std::string text;
  };
  std::vector<Item> items;
  bool any_hold = false, any_wait = false, any_call = false;
  for (const PanelLayout& l : layouts) {
    for (const Bar& b : l.bars) (b.wait ? any_wait : any_hold) = true;
    any_call = any_call || !l.calls.empty();
  }
  if (any_call)
    items.push_back({R"(<rect x="-1.5" y="-9" width="3" height="18" fill="#9ca3af"/>)",
                     "a request open (send ... answer)"});
  if (any_hold)
    items.push_back({R"(<rect x="-4" y="-9" width="8" height="18" fill="#93c5fd" )"
                     R"(stroke="#1d4ed8"/>)",
                     "holds the key (reserve ... complete/release)"});
  if (any_wait)
    items.push_back({R"(<rect x="-4" y="-9" width="8" height="18" fill="#fff7ed" )"
                     R"(stroke="#d97706" stroke-dasharray="3,2"/>)",
                     "waits (wait ... wake/replay)"});
  for (Mark m : kAllMarks)
    if (used.count(m) != 0) items.push_back({shape(m), std::string(meaning(m))});
  const double legend_top = bottom_y + 26;
  std::vector<std::pair<double, double>> item_pos;
  {
    double ix = kAxisX, iy = legend_top + 14;
    for (const Item& it : items) {
      const double w = 24 + text_width(it.text, kLabelFont) * 1.1 + 22;
      if (ix + w > width - 10 && ix > kAxisX) {
        ix = kAxisX;
        iy += 24;
      }
      item_pos.emplace_back(ix, iy);
      ix += w;
    }
  }
  const double height = (item_pos.empty() ? legend_top : item_pos.back().second) + 30;
  width = std::ceil(width);

  // Writing.
  std::string out;
  auto put = [&out](std::string_view s) { out += s; };
  put(R"(<?xml version="1.0" encoding="UTF-8" standalone="no"?>)"
      "\n");
  out += fmt::format(
      R"(<svg xmlns="http://www.w3.org/2000/svg" version="1.1" width="{0}" height="{1}" )"
      R"(viewBox="0 0 {0} {1}" font-family="{2}">)"
      "\n",
      num(width), num(std::ceil(height)), kFont);
  out += fmt::format("<title>{}</title>\n", escape(title));
  out += fmt::format(R"(<rect width="{}" height="{}" fill="#ffffff"/>)"
                     "\n",
                     num(width), num(std::ceil(height)));
  out +=
      fmt::format(R"(<text class="figure-title" x="{}" y="{}" font-size="17" font-weight="bold" )"
                  R"(fill="#111827">{}</text>)"
                  "\n",
                  num(kAxisX - 50), num(title_y), escape(title));

  // The panels' backgrounds, under the axis grid.
  for (const PanelLayout& l : layouts) {
    out += fmt::format(R"(<rect class="panel-frame" x="{}" y="{}" width="{}" height="{}" rx="6" )"
                       R"(fill="#f8fafc" stroke="#cbd5e1"/>)"
                       "\n",
                       num(l.x), num(panel_top), num(l.width), num(bottom_y - panel_top));
  }

  // The time axis: a tick at each instant, a grid line across the panels, breaks.
  out += R"(<g class="axis" font-size="11" fill="#374151">)"
         "\n";
  out += fmt::format(R"(<text x="{}" y="{}" text-anchor="end" font-weight="bold">time</text>)"
                     "\n",
                     num(kAxisX - 4), num(lane_title_y));
  out += fmt::format(R"(<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="#6b7280"/>)"
                     "\n",
                     num(kAxisX), num(first_y - 10), num(bottom_y));
  for (std::size_t i = 0; i < instants.size(); ++i) {
    if (broken[i]) {
      const double mid = (ys[i - 1] + static_cast<double>(rows[i - 1] - 1) * kRow + ys[i]) / 2;
      out +=
          fmt::format(R"(<rect x="{}" y="{}" width="{}" height="8" fill="#ffffff" opacity="0.9"/>)"
                      R"(<path d="M{},{} l10,-4 M{},{} l10,-4" stroke="#6b7280"/>)"
                      R"(<text x="{}" y="{}" text-anchor="end" font-style="italic" fill="#6b7280">)"
                      R"(+{} ms</text>)"
                      "\n",
                      num(kAxisX - 8), num(mid - 4), num(width - kAxisX), num(kAxisX - 5),
                      num(mid + 1), num(kAxisX - 5), num(mid + 5), num(kAxisX - 8), num(mid - 6),
                      instants[i] - instants[i - 1]);
    }
    out += fmt::format(R"(<line x1="{0}" y1="{1}" x2="{2}" y2="{1}" stroke="#e2e8f0"/>)"
                       R"(<line x1="{3}" y1="{1}" x2="{0}" y2="{1}" stroke="#6b7280"/>)"
                       R"(<text class="tick" x="{4}" y="{5}" text-anchor="end">{6}</text>)"
                       "\n",
                       num(kAxisX), num(ys[i]), num(width - 8), num(kAxisX - 4), num(kAxisX - 6),
                       num(ys[i] + 4), escape(ms_label(instants[i])));
  }
  out += "</g>\n";

  for (std::size_t pi = 0; pi < layouts.size(); ++pi) {
    const PanelLayout& l = layouts[pi];
    out += fmt::format(R"(<g class="panel" id="panel-{}">)"
                       "\n",
                       pi + 1);
    out +=
        fmt::format(R"(<text class="panel-title" x="{}" y="{}" font-size="14" font-weight="bold" )"
                    R"(fill="#111827">{}</text>)"
                    "\n",
                    num(l.x + 12), num(panel_title_y), escape(l.panel->title));
    if (!l.panel->caption.empty())
      out += fmt::format(
          R"(<text class="caption" x="{}" y="{}" font-size="{}" fill="#4b5563">{}</text>)"
          "\n",
          num(l.x + 12), num(caption_y), num(kLabelFont), escape(l.panel->caption));
    out += fmt::format(R"(<text class="charges" x="{}" y="{}" font-size="12" font-weight="bold" )"
                       R"(fill="{}">{} charge{} made</text>)"
                       "\n",
                       num(l.x + 12), num(charges_y), l.charges > 1 ? "#dc2626" : "#374151",
                       l.charges, l.charges == 1 ? "" : "s");
    for (const Lane& lane : l.lanes) {
      out += fmt::format(
          R"(<line class="lifeline" x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="#94a3b8" )"
          R"(stroke-dasharray="4,3"/>)"
          R"(<text class="lane" x="{0}" y="{3}" text-anchor="middle" font-size="12" )"
          R"(font-weight="bold" fill="#1f2937">{4}</text>)"
          "\n",
          num(lane.x), num(lane_title_y + 8), num(bottom_y - 6), num(lane_title_y),
          escape(lane.name));
    }
    for (const Span& c : l.calls) {
      out +=
          fmt::format(R"(<rect class="call" x="{}" y="{}" width="3" height="{}" fill="#9ca3af"/>)"
                      "\n",
                      num(l.lanes[c.lane].x - 1.5), num(c.y0), num(std::max(c.y1 - c.y0, 1.0)));
    }
    for (const Bar& b : l.bars) {
      const double bx = l.lanes[b.lane].x - static_cast<double>(b.track) * kSubtrack - 4;
      out += fmt::format(R"(<rect class="bar {}" x="{}" y="{}" width="8" height="{}" {}/>)"
                         "\n",
                         b.wait ? "wait" : "hold", num(bx), num(b.y0), num(b.y1 - b.y0),
                         b.wait ? R"(fill="#fff7ed" stroke="#d97706" stroke-dasharray="3,2")"
                                : R"(fill="#93c5fd" stroke="#1d4ed8")");
    }
    for (const Placed& p : l.placed) {
      const TimelineEvent& e = *p.event;
      const double mx = l.lanes[p.lane].x, my = y_of(p);
      const std::string_view detail = e.detail.empty() ? e.text : e.detail;
      out += fmt::format(
          R"svg(<g class="mark {}" transform="translate({},{})"><title>{}</title>{}</g>)svg",
          to_string(e.mark), num(mx), num(my),
          escape(fmt::format("t={} ms {}: {}", e.at_ms, e.lane, detail)), shape(e.mark));
      const bool charge = e.mark == Mark::charge;
      out += fmt::format(R"(<text class="label" x="{}" y="{}" font-size="{}"{}>{}</text>)"
                         "\n",
                         num(mx + (charge ? 12 : 10)), num(my + 4), num(kLabelFont),
                         charge ? R"( font-weight="bold" fill="#b91c1c")" : R"( fill="#111827")",
                         escape(e.text));
    }
    out += "</g>\n";
  }

  out += R"(<g class="legend" font-size="11" fill="#111827">)"
         "\n";
  out += fmt::format(R"(<text x="{}" y="{}" font-weight="bold">Legend</text>)"
                     R"(<text x="{}" y="{}" fill="#4b5563">time flows down; an instant where )"
                     R"(several things happen is stretched to fit them</text>)"
                     "\n",
                     num(kAxisX), num(legend_top - 6), num(kAxisX + 52), num(legend_top - 6));
  for (std::size_t i = 0; i < items.size(); ++i) {
    out += fmt::format(R"svg(<g class="legend-item" transform="translate({},{})">{})svg"
                       R"(<text x="14" y="4">{}</text></g>)"
                       "\n",
                       num(item_pos[i].first + 6), num(item_pos[i].second), items[i].swatch,
                       escape(items[i].text));
  }
  out += "</g>\n</svg>\n";
  return out;
}

}  // namespace idem::sim
