#include "idem/replay_cache.hpp"

#include <fmt/format.h>

#include <functional>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "idem/errors.hpp"

namespace idem {
namespace {

Reservation found(Record r) {
  Reservation out;
  out.kind = Reservation::Kind::existing;
  out.existing = std::move(r);
  return out;
}

struct Entry {
  std::string key;
  Record record;
  std::size_t bytes;
};
using Lru = std::list<Entry>;

// The fixed allowance per entry: the entry (the Record's own fields included) in its list
// node with two links; the index's node with its own copy of the key's std::string, the
// iterator, a link and the cached hash, and its bucket; a malloc header for each node.
constexpr std::size_t kEntryOverhead = sizeof(Entry) + 2 * sizeof(void*) + sizeof(std::string) +
                                       sizeof(Lru::iterator) + 3 * sizeof(void*) + 2 * 16;

std::string key_of(const KeyId& id) {
  // Tenant, operation and key are printable ASCII: a NUL cannot occur in them.
  std::string k;
  k.reserve(id.tenant.size() + id.operation.size() + id.key.size() + 2);
  k.append(id.tenant).push_back('\0');
  k.append(id.operation).push_back('\0');
  k.append(id.key);
  return k;
}

std::size_t bytes_of(const std::string& key, const Record& r) {
  // The key's bytes twice: the entry and the index each hold a copy.
  std::size_t n = kEntryOverhead + 2 * key.size() + r.response.body.size() + r.body_ref.size();
  for (const Header& h : r.response.headers) n += h.name.size() + h.value.size() + 64;
  if (r.recovery_point) n += r.recovery_point->size();
  return n;
}

}  // namespace

struct ReplayCache::Impl {
  ReplayCacheOptions options;
  mutable std::mutex mutex;
  Lru lru;  // guarded by mutex: the most recently used first
  std::unordered_map<std::string, Lru::iterator> index;  // guarded by mutex
  Stats stats;                                           // guarded by mutex

  void erase(Lru::iterator it) {
    stats.bytes -= it->bytes;
    index.erase(it->key);
    lru.erase(it);
  }

  // The live completed record of `id` at `now`, if held.
  std::optional<Record> lookup(const KeyId& id, TimePoint now) {
    const std::string key = key_of(id);
    std::lock_guard lock(mutex);
    const auto found = index.find(key);
    if (found == index.end()) {
      ++stats.misses;
      return std::nullopt;
    }
    const auto it = found->second;
    if (!it->record.live_at(now)) {
      erase(it);
      ++stats.expired;
      ++stats.misses;
      return std::nullopt;
    }
    lru.splice(lru.begin(), lru, it);
    ++stats.hits;
    return it->record;
  }

  // Keeps `r` if it is a completed record live at `now`.
  void remember(const KeyId& id, const Record& r, TimePoint now) {
    if (r.state != State::completed || !r.live_at(now)) return;
    std::string key = key_of(id);
    const std::size_t bytes = bytes_of(key, r);
    if (bytes > options.max_bytes) return;
    std::lock_guard lock(mutex);
    if (const auto found = index.find(key); found != index.end()) erase(found->second);
    lru.push_front(Entry{key, r, bytes});
    index.emplace(std::move(key), lru.begin());
    stats.bytes += bytes;
    while (stats.bytes > options.max_bytes) {
      erase(std::prev(lru.end()));
      ++stats.evictions;
    }
  }

  // What a reserve or store_if_absent op found, kept if it is a completed record.
  void remember_found(const StoreOp& op) {
    if (op.error || op.reservation.kind != Reservation::Kind::existing || !op.reservation.existing)
      return;
    remember(*op.id, *op.reservation.existing, op.now);
  }
};

ReplayCache::ReplayCache(std::shared_ptr<Store> target, ReplayCacheOptions options)
    : StoreWrapper(std::move(target)), impl_(std::make_unique<Impl>()) {
  if (options.max_bytes == 0) {
    throw error(errc::invalid_argument, "idem: ReplayCacheOptions::max_bytes must be positive");
  }
  if (!options.clock) options.clock = std::make_shared<SystemClock>();
  impl_->options = std::move(options);
}

ReplayCache::~ReplayCache() = default;

std::optional<Record> ReplayCache::load(const KeyId& id) {
  const TimePoint now = impl_->options.clock->now();
  if (std::optional<Record> held = impl_->lookup(id, now)) return held;
  std::optional<Record> r = StoreWrapper::load(id);
  if (r) impl_->remember(id, *r, now);
  return r;
}

void ReplayCache::load_many(std::span<StoreRead* const> reads) {
  const TimePoint now = impl_->options.clock->now();
  std::vector<StoreRead*> rest;
  for (StoreRead* r : reads) {
    r->record = impl_->lookup(*r->id, now);
    if (!r->record) rest.push_back(r);
  }
  if (rest.empty()) return;
  target().load_many(rest);
  for (const StoreRead* r : rest) {
    if (r->record) impl_->remember(*r->id, *r->record, now);
  }
}

namespace {

bool looks(const StoreOp& op) {
  return op.kind == StoreOp::Kind::reserve || op.kind == StoreOp::Kind::store_if_absent;
}

}  // namespace

std::vector<StoreOp*> ReplayCache::answer_held(std::span<StoreOp* const> ops) {
  std::vector<StoreOp*> rest;
  rest.reserve(ops.size());
  for (StoreOp* op : ops) {
    if (looks(*op)) {
      if (std::optional<Record> held = impl_->lookup(*op->id, op->now)) {
        op->reservation = found(std::move(*held));
        continue;
      }
    }
    rest.push_back(op);
  }
  return rest;
}

void ReplayCache::remember_all(std::span<StoreOp* const> ops) {
  for (const StoreOp* op : ops) {
    if (looks(*op)) impl_->remember_found(*op);
  }
}

void ReplayCache::apply(std::span<StoreOp* const> ops) {
  const std::vector<StoreOp*> rest = answer_held(ops);
  if (rest.empty()) return;
  StoreWrapper::apply(rest);
  remember_all(rest);
}

namespace {

// The target's batch for the ops the cache could not answer; remembers what it found once
// it is done.
class CachedPending final : public PendingApply {
 public:
  CachedPending(ReplayCache& cache, std::vector<StoreOp*> rest,
                std::function<void(std::span<StoreOp* const>)> remember)
      : rest_(std::move(rest)), remember_(std::move(remember)) {
    inner_ = cache.target().start_apply(rest_);
    if (!inner_) {  // the target cannot: apply here
      cache.target().apply(rest_);
      conclude();
    } else if (inner_->done()) {
      conclude();
    }
  }

  int descriptor() const noexcept override { return done_ ? -1 : inner_->descriptor(); }
  std::chrono::steady_clock::time_point deadline() const noexcept override {
    return done_ ? std::chrono::steady_clock::time_point::max() : inner_->deadline();
  }
  bool done() const noexcept override { return done_; }
  void advance() noexcept override {
    if (done_) return;
    inner_->advance();
    if (inner_->done()) conclude();
  }
  void fail(std::exception_ptr why) noexcept override {
    if (done_) return;
    inner_->fail(std::move(why));
    conclude();
  }

 private:
  void conclude() noexcept {
    done_ = true;
    try {
      remember_(rest_);
    } catch (...) {  // remembering is an optimisation: a record not held is read again
    }
  }

  std::vector<StoreOp*> rest_;  // the target's span points here: kept until done
  std::function<void(std::span<StoreOp* const>)> remember_;
  std::unique_ptr<PendingApply> inner_;
  bool done_ = false;
};

// Nothing left for the target: every op was answered from memory.
class DonePending final : public PendingApply {
 public:
  int descriptor() const noexcept override { return -1; }
  std::chrono::steady_clock::time_point deadline() const noexcept override {
    return std::chrono::steady_clock::time_point::max();
  }
  bool done() const noexcept override { return true; }
  void advance() noexcept override {}
  void fail(std::exception_ptr) noexcept override {}
};

}  // namespace

std::unique_ptr<PendingApply> ReplayCache::start_apply(std::span<StoreOp* const> ops) {
  std::vector<StoreOp*> rest = answer_held(ops);
  if (rest.empty()) return std::make_unique<DonePending>();
  return std::make_unique<CachedPending>(
      *this, std::move(rest), [this](std::span<StoreOp* const> done) { remember_all(done); });
}

ReplayCache::Stats ReplayCache::stats() const {
  std::lock_guard lock(impl_->mutex);
  Stats s = impl_->stats;
  s.entries = impl_->lru.size();
  return s;
}

std::string ReplayCache::to_prometheus() const {
  const Stats s = stats();
  std::string out;
  const auto counter = [&](std::string_view name, std::uint64_t v, std::string_view help) {
    out += fmt::format(
        "# HELP idem_replay_cache_{0}_total {2}\n# TYPE idem_replay_cache_{0}_total counter\n"
        "idem_replay_cache_{0}_total {1}\n",
        name, v, help);
  };
  const auto gauge = [&](std::string_view name, std::size_t v, std::string_view help) {
    out += fmt::format(
        "# HELP idem_replay_cache_{0} {2}\n# TYPE idem_replay_cache_{0} gauge\n"
        "idem_replay_cache_{0} {1}\n",
        name, v, help);
  };
  counter("hits", s.hits, "Lookups answered from memory.");
  counter("misses", s.misses, "Lookups that went to the store.");
  counter("evictions", s.evictions, "Records dropped to stay within max_bytes.");
  counter("expired", s.expired, "Records dropped at their expiry.");
  gauge("entries", s.entries, "Completed records held.");
  gauge("bytes", s.bytes, "Bytes the held records count for.");
  return out;
}

}  // namespace idem
