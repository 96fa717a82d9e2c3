#include "idem/sim/faulty_store.hpp"

#include <sqlite3.h>  // only for the result codes a real outage would carry

#include <vector>

#include "idem/errors.hpp"

namespace idem::sim {
namespace {

unsigned bit(Operation op) { return 1u << static_cast<unsigned>(op); }

Operation operation_of(StoreOp::Kind kind) {
  switch (kind) {
    case StoreOp::Kind::reserve:
      return Operation::reserve;
    case StoreOp::Kind::complete:
      return Operation::complete;
    case StoreOp::Kind::release:
      return Operation::release;
    case StoreOp::Kind::store_if_absent:
      return Operation::store_if_absent;
  }
  return Operation::reserve;
}

int code_of(Operation op) {
  switch (op) {
    case Operation::load:
      return SQLITE_IOERR_READ;
    case Operation::complete:
    case Operation::store_if_absent:
    case Operation::steps:
    case Operation::mark_pending:
      return SQLITE_FULL;
    default:
      return SQLITE_IOERR_WRITE;
  }
}

}  // namespace

void FaultyStore::fail(Operation op, bool on) noexcept {
  if (on) {
    failing_.fetch_or(bit(op));
  } else {
    failing_.fetch_and(~bit(op));
  }
}

bool FaultyStore::failing(Operation op) const noexcept { return (failing_.load() & bit(op)) != 0; }

void FaultyStore::set_unreachable(bool down) noexcept { failing_ = down ? ~0u : 0u; }

void FaultyStore::lose_replies(Operation op, bool on) noexcept {
  if (on) {
    losing_.fetch_or(bit(op));
  } else {
    losing_.fetch_and(~bit(op));
  }
}

bool FaultyStore::losing(Operation op) const noexcept { return (losing_.load() & bit(op)) != 0; }

void FaultyStore::fail_if(Operation op) const {
  if (failing(op)) {
    throw StoreError("simulated outage: the store is unreachable (disk I/O error)", code_of(op));
  }
}

StoreError FaultyStore::lost_reply() {
  return StoreError(
      "simulated lost reply: the write reached the store, and its answer never came back "
      "(the connection broke)",
      0);
}

bool FaultyStore::renew(const KeyId& id, std::int64_t token, TimePoint lease) {
  return through(Operation::renew, [&] { return StoreWrapper::renew(id, token, lease); });
}

std::optional<Record> FaultyStore::load(const KeyId& id) {
  return through(Operation::load, [&] { return StoreWrapper::load(id); });
}

void FaultyStore::apply(std::span<StoreOp* const> ops) {
  std::vector<StoreOp*> healthy;
  healthy.reserve(ops.size());
  for (StoreOp* op : ops) {
    try {
      fail_if(operation_of(op->kind));
      healthy.push_back(op);
    } catch (const StoreError&) {
      op->error = std::current_exception();
    }
  }
  if (healthy.empty()) return;
  StoreWrapper::apply(healthy);
  for (StoreOp* op : healthy) {
    if (op->error || !losing(operation_of(op->kind))) continue;
    op->reservation = {};
    op->applied = false;
    op->error = std::make_exception_ptr(lost_reply());
  }
}

std::optional<Progress> FaultyStore::begin_steps(const KeyId& id, std::int64_t token,
                                                 const std::string& request) {
  return through(Operation::steps, [&] { return StoreWrapper::begin_steps(id, token, request); });
}

bool FaultyStore::mark_pending(const KeyId& id, std::int64_t token, std::int64_t origin,
                               const std::string& step, const LeaseCheck& lease) {
  return through(Operation::mark_pending,
                 [&] { return StoreWrapper::mark_pending(id, token, origin, step, lease); });
}

bool FaultyStore::commit_step(const KeyId& id, std::int64_t token, std::int64_t origin,
                              const StepCommit& step) {
  return through(Operation::steps,
                 [&] { return StoreWrapper::commit_step(id, token, origin, step); });
}

std::vector<AbandonedOperation> FaultyStore::abandoned(TimePoint idle_before, TimePoint now,
                                                       std::size_t limit,
                                                       std::span<const std::string> operations) {
  return through(Operation::steps,
                 [&] { return StoreWrapper::abandoned(idle_before, now, limit, operations); });
}

std::vector<OutboxMessage> FaultyStore::claim_outbox(TimePoint now, TimePoint claim_until,
                                                     std::size_t limit) {
  return through(Operation::outbox,
                 [&] { return StoreWrapper::claim_outbox(now, claim_until, limit); });
}

std::size_t FaultyStore::outbox_delivered(std::span<const std::string> ids, TimePoint now) {
  return through(Operation::outbox, [&] { return StoreWrapper::outbox_delivered(ids, now); });
}

void FaultyStore::outbox_failed(const std::string& id, TimePoint retry_at, bool park,
                                const std::string& why) {
  through(Operation::outbox, [&] {
    StoreWrapper::outbox_failed(id, retry_at, park, why);
    return true;
  });
}

OutboxCounts FaultyStore::outbox_counts() {
  return through(Operation::outbox, [&] { return StoreWrapper::outbox_counts(); });
}

std::size_t FaultyStore::purge_outbox(TimePoint delivered_before, std::size_t limit) {
  return through(Operation::outbox,
                 [&] { return StoreWrapper::purge_outbox(delivered_before, limit); });
}

std::size_t FaultyStore::purge_expired(TimePoint now, std::size_t limit) {
  return through(Operation::purge, [&] { return StoreWrapper::purge_expired(now, limit); });
}

std::vector<ReapedRecord> FaultyStore::reap(TimePoint before, std::size_t limit) {
  return through(Operation::reap, [&] { return StoreWrapper::reap(before, limit); });
}

}  // namespace idem::sim
