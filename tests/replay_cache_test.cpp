// The replay cache in front of a store, on simulated time: hot keys answered from memory,
// never an in-progress or expired record, 422 still 422, memory bounded. Each test counts the
// provider's charges and the wrapped store's reads and writes.
#include "idem/replay_cache.hpp"

#include <doctest/doctest.h>

#include <fmt/format.h>
#include <atomic>
#include <vector>

#include "idem/coordinator.hpp"
#include "test_support.hpp"

using namespace std::chrono_literals;
using idem::test::request;

namespace {

// Counts what reaches the store behind the cache.
class CountingStore final : public idem::StoreWrapper {
 public:
  using StoreWrapper::StoreWrapper;
  std::atomic<int> loads{0}, looks{0}, writes{0};  // looks: reserves and store_if_absents

  std::vector<std::size_t> batches;  // load_many's, by size

  std::optional<idem::Record> load(const idem::KeyId& id) override {
    ++loads;
    return StoreWrapper::load(id);
  }
  void load_many(std::span<idem::StoreRead* const> reads) override {
    batches.push_back(reads.size());
    StoreWrapper::load_many(reads);  // Store's: load() for each, counted above
  }
  void apply(std::span<idem::StoreOp* const> ops) override {
    for (const idem::StoreOp* op : ops) {
      const bool look = op->kind == idem::StoreOp::Kind::reserve ||
                        op->kind == idem::StoreOp::Kind::store_if_absent;
      ++(look ? looks : writes);
    }
    StoreWrapper::apply(ops);
  }
  int touched() const { return loads + looks + writes; }
};

struct CachedWorld {
  idem::test::TempDir dir;
  std::shared_ptr<idem::sim::SimulatedClock> clock = std::make_shared<idem::sim::SimulatedClock>();
  std::shared_ptr<idem::SqliteStore> sqlite =
      std::make_shared<idem::SqliteStore>(dir.file("keys.db"));
  std::shared_ptr<CountingStore> counted = std::make_shared<CountingStore>(sqlite);
  std::shared_ptr<idem::ReplayCache> cache;
  std::shared_ptr<idem::sim::Provider> provider =
      std::make_shared<idem::sim::Provider>(clock, idem::sim::ProviderOptions{.latency = 0ms});
  std::unique_ptr<idem::Coordinator> idem;

  explicit CachedWorld(std::size_t max_bytes = std::size_t{1} << 20, idem::Options options = {}) {
    cache = std::make_shared<idem::ReplayCache>(
        counted, idem::ReplayCacheOptions{.max_bytes = max_bytes, .clock = clock});
    options.clock = clock;
    idem = std::make_unique<idem::Coordinator>(cache, std::move(options));
  }

  idem::Outcome charge(const std::string& key, long long amount = 4990) {
    return idem->call(request(key, amount), [&] {
      return idem::Response{200, provider->charge("A-1", amount, "").charge_id, {}};
    });
  }
};

}  // namespace

TEST_CASE("replay cache: a hot key's replays and key-reuse checks touch no store") {
  CachedWorld w;
  CHECK(w.charge("k1").response.body == "ch_1");
  for (int i = 0; i < 100; ++i) {
    const idem::Outcome o = w.charge("k1");
    CHECK(o.replayed());
    CHECK(o.response.body == "ch_1");
  }
  // The first replay found the record in the store (and kept it); no other did.
  const int after_replays = w.counted->touched();
  const idem::ReplayCache::Stats s = w.cache->stats();
  CHECK(s.hits >= 99);
  CHECK(s.entries == 1);
  // Another amount under the same key: 422 from memory too.
  CHECK_THROWS_AS(w.charge("k1", 100), idem::KeyReuseError);
  CHECK(w.counted->touched() == after_replays);
  CHECK(w.provider->charge_count() == 1);
}

TEST_CASE(
    "replay cache: load_many answers the keys it holds from memory and sends the rest to the "
    "store together") {
  CachedWorld w;
  for (const char* key : {"k1", "k2", "k3"}) w.charge(key);
  const idem::KeyId k1{"alpha", "payment.charge", "k1"}, k2{"alpha", "payment.charge", "k2"},
      k3{"alpha", "payment.charge", "k3"}, k4{"alpha", "payment.charge", "k4"};
  const auto read_all = [&w](std::vector<idem::StoreRead>& reads) {
    std::vector<idem::StoreRead*> batch;
    for (idem::StoreRead& r : reads) batch.push_back(&r);
    w.cache->load_many(batch);
  };
  std::vector<idem::StoreRead> first = {{&k1}, {&k2}, {&k3}, {&k4}};
  read_all(first);  // none held yet: one batch of four behind the cache
  CHECK(w.counted->batches == std::vector<std::size_t>{4});
  for (std::size_t i = 0; i < 3; ++i)
    CHECK(first[i].record->response.body == fmt::format("ch_{}", i + 1));
  CHECK_FALSE(first[3].record);
  CHECK(w.cache->stats().entries == 3);
  std::vector<idem::StoreRead> again = {{&k2}, {&k4}, {&k1}};
  read_all(again);  // k1 and k2 from memory: only k4 goes on
  CHECK(w.counted->batches == std::vector<std::size_t>{4, 1});
  CHECK(again[0].record->response.body == "ch_2");
  CHECK(again[2].record->response.body == "ch_1");
  CHECK_FALSE(again[1].record);
  for (const idem::StoreRead& r : again) CHECK_FALSE(r.error);
  CHECK(w.provider->charge_count() == 3);
}

TEST_CASE("replay cache: an in-progress or released record is never held") {
  CachedWorld w;
  const idem::KeyId id{"alpha", "payment.charge", "k1"};
  const idem::Fingerprint fp = request("k1").fingerprint;
  const idem::Reservation r = w.cache->reserve(id, fp, w.clock->now(), w.clock->now() + 30s);
  REQUIRE(r.kind == idem::Reservation::Kind::reserved);
  for (int i = 0; i < 3; ++i) {
    CHECK(w.cache->load(id)->state == idem::State::in_progress);
    CHECK(w.cache->reserve(id, fp, w.clock->now(), w.clock->now() + 30s).kind ==
          idem::Reservation::Kind::existing);
  }
  CHECK(w.counted->loads == 3);
  CHECK(w.counted->looks == 4);
  CHECK(w.cache->stats().entries == 0);
  REQUIRE(w.cache->release(id, r.token, w.clock->now()));
  CHECK(w.cache->load(id)->state == idem::State::released);
  CHECK(w.cache->stats().entries == 0);
  // The key is free again: the next call really runs.
  CHECK(w.charge("k1").source == idem::Outcome::Source::executed);
  CHECK(w.provider->charge_count() == 1);
}

TEST_CASE("replay cache: nothing is served at or after the record's expiry") {
  idem::Options options;
  options.ttl = 1min;
  options.lease = 30s;
  options.heartbeat = 10s;
  CachedWorld w(std::size_t{1} << 20, options);
  CHECK(w.charge("k1").response.body == "ch_1");
  CHECK(w.charge("k1").replayed());
  CHECK(w.charge("k1").replayed());
  w.clock->advance(1min - 1ms);
  CHECK(w.charge("k1").replayed());  // the last millisecond of the TTL
  w.clock->advance(1ms);
  const idem::Outcome again = w.charge("k1");  // the TTL is over: the key is new
  CHECK(again.source == idem::Outcome::Source::executed);
  CHECK(again.response.body == "ch_2");
  CHECK(w.provider->charge_count() == 2);
  CHECK(w.cache->stats().expired == 1);
  CHECK(w.charge("k1").response.body == "ch_2");
}

TEST_CASE("replay cache: held bytes stay within max_bytes, the least recently used go first") {
  CachedWorld w(4096);
  for (int i = 0; i < 50; ++i) w.charge("k" + std::to_string(i));
  for (int i = 0; i < 50; ++i) CHECK(w.charge("k" + std::to_string(i)).replayed());
  const idem::ReplayCache::Stats s = w.cache->stats();
  CHECK(s.bytes <= 4096);
  CHECK(s.evictions > 0);
  CHECK(s.entries < 50);
  // The most recent keys are held; an evicted one is answered by the store, still once.
  const int before = w.counted->touched();
  CHECK(w.charge("k49").replayed());
  CHECK(w.counted->touched() == before);
  CHECK(w.charge("k0").replayed());
  CHECK(w.counted->touched() > before);
  CHECK(w.provider->charge_count() == 50);
  CHECK_THROWS_AS(idem::ReplayCache(w.counted, idem::ReplayCacheOptions{.max_bytes = 0}),
                  idem::error);
}

TEST_CASE("replay cache: its counters export as Prometheus text") {
  CachedWorld w;
  w.charge("k1");
  w.charge("k1");
  w.charge("k1");
  const std::string text = w.cache->to_prometheus();
  CHECK(text.find("idem_replay_cache_hits_total 1\n") != std::string::npos);
  CHECK(text.find("# TYPE idem_replay_cache_entries gauge\nidem_replay_cache_entries 1\n") !=
        std::string::npos);
}
