// The gRPC section: unary calls per second through idem::grpc::Guard on loopback gRPC, with the
// guard and without it (the same service, its body run directly), back to back in one run, so
// the guard's price is read against the same gRPC stack on the same machine.
#include "grpc_bench.hpp"

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <latch>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench.hpp"
#include "idem/coordinator.hpp"
#include "idem/grpc.hpp"
#include "idem/sqlite_store.hpp"
#include "idem_test.grpc.pb.h"
#include "idem_test.pb.h"

namespace idem::bench {
namespace {

using idemtest::ChargeReply;
using idemtest::ChargeRequest;
using idemtest::Payments;
using nlohmann::json;
using namespace std::chrono_literals;

constexpr const char* kMethod = "/idemtest.Payments/Charge";

// Any answer the bench did not expect ends it: counting a wrong answer as throughput would lie.
[[noreturn]] void fail(const std::string& what) { throw std::runtime_error("grpc bench: " + what); }

// The method's body is a trivial effect (a counter and a charge id): the bench measures the
// guard's price, not a provider's latency. With a guard every call goes through it; without
// one the body runs directly, so the two servers differ by the guard alone.
class BenchPayments final : public Payments::Service {
 public:
  explicit BenchPayments(idem::grpc::Guard* guard) : guard_(guard) {}

  ::grpc::Status Charge(::grpc::ServerContext* context, const ChargeRequest* request,
                        ChargeReply* reply) override {
    if (guard_ == nullptr) return charge(*reply);
    return guard_->unary(*context, kMethod, *request, *reply,
                         [&](idem::grpc::Context&) { return charge(*reply); });
  }

  // How many times the body has run: what the answers claim is checked against it.
  std::uint64_t runs() const noexcept { return runs_.load(); }

 private:
  ::grpc::Status charge(ChargeReply& reply) {
    reply.set_charge_id(fmt::format("ch_{}", ++runs_));
    return ::grpc::Status::OK;
  }

  idem::grpc::Guard* guard_;
  std::atomic<std::uint64_t> runs_{0};
};

// A synchronous server on 127.0.0.1 and a free port, guarded (a SQLite store on a fresh file
// under `dir`, default coordinator options) or not, and the client's one channel to it. Shut
// down however the bench leaves (an abort included).
class Loopback {
 public:
  Loopback(const std::string& dir, bool guarded) : name_(guarded ? "guard" : "no guard") {
    if (guarded) {
      const std::string db = dir + "/grpc-guard.db";
      for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(db + suffix);
      coordinator_ = std::make_unique<Coordinator>(std::make_shared<SqliteStore>(db), Options{});
      guard_ = std::make_unique<idem::grpc::Guard>(*coordinator_);
    }
    service_ = std::make_unique<BenchPayments>(guard_.get());
    ::grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", ::grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port <= 0) fail(name_ + ": the server did not start");
    stub_ = Payments::NewStub(::grpc::CreateChannel(fmt::format("127.0.0.1:{}", port),
                                                    ::grpc::InsecureChannelCredentials()));
  }
  ~Loopback() { server_->Shutdown(std::chrono::system_clock::now() + 5s); }
  Loopback(const Loopback&) = delete;
  Loopback& operator=(const Loopback&) = delete;

  const std::string& name() const noexcept { return name_; }
  bool guarded() const noexcept { return guard_ != nullptr; }
  Payments::Stub& stub() noexcept { return *stub_; }
  std::uint64_t runs() const noexcept { return service_->runs(); }
  // Fresh keys are never used twice on a server: each run takes the next `n`.
  std::size_t take_keys(std::size_t n) noexcept { return (keys_used_ += n) - n; }

 private:
  std::string name_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<idem::grpc::Guard> guard_;
  std::unique_ptr<BenchPayments> service_;
  std::unique_ptr<::grpc::Server> server_;
  std::unique_ptr<Payments::Stub> stub_;
  std::size_t keys_used_ = 0;
};

// Every call sends the same request: with the guard a replay is of the same request, so its
// fingerprint matches.
ChargeRequest order() {
  ChargeRequest r;
  r.set_amount(4990);
  r.set_currency("RUB");
  r.set_order_id("A-10023");
  return r;
}

struct Answer {
  ::grpc::Status status;
  ChargeReply reply;
  bool replayed = false;  // trailing metadata "idempotent-replayed: true"
};

// One blocking call with `key` as its idempotency key. The deadline only keeps a silent server
// from hanging the bench; it is never reached when all is well.
Answer call(Payments::Stub& stub, const ChargeRequest& request, const std::string& key) {
  ::grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 30s);
  context.AddMetadata("idempotency-key", key);
  Answer a;
  a.status = stub.Charge(&context, request, &a.reply);
  const auto& trailers = context.GetServerTrailingMetadata();
  const auto it = trailers.find("idempotent-replayed");
  a.replayed = it != trailers.end() && it->second == ::grpc::string_ref("true");
  return a;
}

// What every answer of a run must be: OK, with a charge id (`charge_id` itself when given),
// replayed or not as `replayed` says (a fresh call that comes back replayed means keys
// collided).
void expect(const Answer& a, const std::string& phase, bool replayed,
            const std::string& charge_id = {}) {
  if (!a.status.ok()) {
    fail(fmt::format("{}: expected OK, got status {} {}", phase,
                     static_cast<int>(a.status.error_code()), a.status.error_message()));
  }
  if (a.reply.charge_id().empty() || (!charge_id.empty() && a.reply.charge_id() != charge_id)) {
    fail(fmt::format("{}: expected the charge id {}, got '{}'", phase,
                     charge_id.empty() ? "of a run" : charge_id, a.reply.charge_id()));
  }
  if (a.replayed != replayed) {
    fail(fmt::format("{}: expected the answer {}replayed, got it {}replayed", phase,
                     replayed ? "" : "not ", a.replayed ? "" : "not "));
  }
}

// The body's own count of runs must match what the answers claim.
void expect_ran(const Loopback& s, std::uint64_t before, std::uint64_t expected,
                const std::string& phase) {
  const std::uint64_t after = s.runs();
  if (after != before + expected) {
    fail(fmt::format("{}: the body ran {} times; the answers say {}", phase, after - before,
                     expected));
  }
}

// `calls` blocking calls shared by `width` threads on the server's one channel, call i with
// the key key_at(i), every answer checked by `check`. The threads start together once all
// exist; the first wrong answer stops them all and is thrown once they have stopped.
Stats drive(Loopback& s, std::size_t width, std::size_t calls,
            const std::function<std::string(std::size_t)>& key_at,
            const std::function<void(const Answer&)>& check) {
  const ChargeRequest request = order();
  std::vector<Lane> lanes(width);
  std::atomic<std::size_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex failed_mutex;
  std::exception_ptr failed;
  std::latch start(1);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < width; ++t) {
    threads.emplace_back([&, t] {
      Lane& lane = lanes[t];
      lane.latencies_us.reserve(calls / width + 1);
      start.wait();
      try {
        for (std::size_t i = next++; i < calls && !stop; i = next++) {
          const std::string key = key_at(i);
          const auto t0 = Clock::now();
          const Answer a = call(s.stub(), request, key);
          lane.latencies_us.push_back(micros_since(t0));
          check(a);
        }
      } catch (...) {
        const std::lock_guard lock(failed_mutex);
        if (!failed) failed = std::current_exception();
        stop = true;
      }
      lane.ended = Clock::now();
    });
  }
  const auto t0 = Clock::now();
  start.count_down();
  for (std::thread& t : threads) t.join();
  if (failed) std::rethrow_exception(failed);
  return collect(lanes, t0);
}

// Every call a new key: the body runs every time (with the guard: reserve, run, store).
Stats fresh(Loopback& s, std::size_t width, std::size_t calls) {
  const std::string phase = fmt::format("{}: fresh keys at {} concurrent", s.name(), width);
  const std::size_t base = s.take_keys(calls);
  const std::uint64_t before = s.runs();
  const Stats st = drive(
      s, width, calls, [base](std::size_t i) { return fmt::format("fresh-{}", base + i); },
      [&phase](const Answer& a) { expect(a, phase, false); });
  expect_ran(s, before, calls, phase);
  return st;
}

// One key runs once (not measured), then every call repeats it: with the guard every repeat
// is the stored answer, the first call's charge id, and the body never runs again.
Stats replay(Loopback& s, std::size_t width, std::size_t calls) {
  const std::string phase = fmt::format("{}: replays at {} concurrent", s.name(), width);
  const std::string key = fmt::format("replay-{}", width);
  const std::uint64_t before = s.runs();
  const Answer first = call(s.stub(), order(), key);
  expect(first, phase + " (first call)", false);
  const std::string charge_id = first.reply.charge_id();
  const Stats st = drive(
      s, width, calls, [&key](std::size_t) { return key; },
      [&](const Answer& a) { expect(a, phase, true, charge_id); });
  expect_ran(s, before, 1, phase);
  return st;
}

// The run of median throughput, of an odd number of runs.
Stats median_run(std::vector<Stats> runs) {
  std::sort(runs.begin(), runs.end(),
            [](const Stats& a, const Stats& b) { return a.per_s < b.per_s; });
  return runs[runs.size() / 2];
}

}  // namespace

json run_grpc(bool quick, const std::string& dir, std::ostream* human) {
  // Pairs of fresh runs, guarded and unguarded back to back (their order alternating), the
  // median of kPairs: this VM's speed drifts over seconds, and a ratio of two runs taken far
  // apart would measure the drift as much as the guard.
  constexpr int kPairs = 3;
  // A run's calls: enough that a run lasts a quarter of a second or more on 2 cores even
  // --quick (a loopback call takes 100-200 us), since shorter runs scatter the ratio.
  struct Width {
    std::size_t concurrent = 0;
    std::size_t calls = 0;  // a run's calls
  };
  const std::vector<Width> widths = {{1, quick ? 1500u : 10000u}, {64, quick ? 5000u : 40000u}};
  auto line = [&](const std::string& name, const Stats& s) {
    if (human == nullptr) return;
    *human << fmt::format(
        "  {:<46} {:>10.0f}/s  p50 {:>8.1f} us  p99 {:>8.1f} us  max {:>9.1f} us\n", name, s.per_s,
        s.p50_us, s.p99_us, s.max_us);
  };
  auto label = [](const std::string& what, std::size_t width) {
    return fmt::format("{}, {} concurrent", what, width);
  };

  if (human != nullptr) {
    *human << fmt::format(
        "\ngrpc: unary calls on loopback (blocking client threads, one channel), with the guard "
        "(SQLite) and without\n  ({} calls a line at 1 concurrent, {} at 64; fresh and no "
        "guard: the median of {} back-to-back pairs)\n",
        widths[0].calls, widths[1].calls, kPairs);
  }
  Loopback guarded(dir, true);
  Loopback bare(dir, false);
  // The channels connect, and the servers start their threads, before anything is measured.
  for (Loopback* s : {&guarded, &bare}) fresh(*s, 64, 256);

  json out = json::object();
  json& g = out["grpc"];
  for (const Width& w : widths) {
    std::vector<Stats> with_guard, without;
    std::vector<double> ratios;
    for (int pair = 0; pair < kPairs; ++pair) {
      Stats f, b;
      if (pair % 2 == 0) {
        f = fresh(guarded, w.concurrent, w.calls);
        b = fresh(bare, w.concurrent, w.calls);
      } else {
        b = fresh(bare, w.concurrent, w.calls);
        f = fresh(guarded, w.concurrent, w.calls);
      }
      with_guard.push_back(f);
      without.push_back(b);
      ratios.push_back(f.per_s / b.per_s);
    }
    const Stats f = median_run(with_guard);
    const Stats b = median_run(without);
    const Stats r = replay(guarded, w.concurrent, w.calls);
    line(label("guard: fresh keys", w.concurrent), f);
    line(label("guard: replays of one key", w.concurrent), r);
    line(label("no guard: the body directly", w.concurrent), b);
    json& at = g[std::to_string(w.concurrent)];
    at["fresh"] = f.json();
    at["replay"] = r.json();
    at["unguarded"] = b.json();
    at["guard_ratio"] = median(ratios);
    at["guard_ratio_pairs"] = ratios;
  }
  out["grpc_fresh_calls_per_s"] = g["64"]["fresh"]["per_s"];
  out["grpc_replay_calls_per_s"] = g["64"]["replay"]["per_s"];
  out["grpc_guard_ratio"] = g["64"]["guard_ratio"];
  if (human != nullptr) {
    *human << fmt::format(
        "  the guard's price: fresh with the guard / no guard = {:.2f} at 1 concurrent, {:.2f} "
        "at 64 (medians of {} pairs)\n",
        g["1"]["guard_ratio"].get<double>(), g["64"]["guard_ratio"].get<double>(), kPairs);
  }
  return out;
}

}  // namespace idem::bench
