#include "idem/sim/faulty_store.hpp"

#include <sqlite3.h>  // only for the result codes a real outage would carry

#include "idem/errors.hpp"

namespace idem::sim {
namespace {

void fail_if(const std::atomic<bool>& flag, int code) {
  if (flag) throw StoreError("simulated outage: the store is unreachable (disk I/O error)", code);
}

}  // namespace

Reservation FaultyStore::reserve(const KeyId& id, const Fingerprint& fp, TimePoint now,
                                 TimePoint lease) {
  fail_if(fail_reserve, SQLITE_IOERR_WRITE);
  return inner_->reserve(id, fp, now, lease);
}

bool FaultyStore::complete(const KeyId& id, std::int64_t token, const StoredResponse& r,
                           TimePoint expires) {
  fail_if(fail_complete, SQLITE_FULL);
  return inner_->complete(id, token, r, expires);
}

bool FaultyStore::release(const KeyId& id, std::int64_t token, TimePoint now) {
  fail_if(fail_release, SQLITE_IOERR_WRITE);
  return inner_->release(id, token, now);
}

bool FaultyStore::renew(const KeyId& id, std::int64_t token, TimePoint lease) {
  return inner_->renew(id, token, lease);
}

bool FaultyStore::set_recovery_point(const KeyId& id, std::int64_t token, const std::string& point) {
  return inner_->set_recovery_point(id, token, point);
}

std::optional<Record> FaultyStore::load(const KeyId& id) {
  fail_if(fail_load, SQLITE_IOERR_READ);
  return inner_->load(id);
}

std::optional<Record> FaultyStore::store_if_absent(const KeyId& id, const Fingerprint& fp,
                                                   const StoredResponse& r, TimePoint now,
                                                   TimePoint expires) {
  fail_if(fail_complete, SQLITE_FULL);
  return inner_->store_if_absent(id, fp, r, now, expires);
}

void FaultyStore::apply(std::span<StoreOp* const> ops) {
  if (fail_reserve || fail_complete || fail_release) {
    Store::apply(ops);  // op by op, through the switches above
  } else {
    inner_->apply(ops);
  }
}

std::size_t FaultyStore::purge_expired(TimePoint now, std::size_t limit) {
  return inner_->purge_expired(now, limit);
}

std::vector<ReapedRecord> FaultyStore::reap(TimePoint before, std::size_t limit) {
  return inner_->reap(before, limit);
}

}  // namespace idem::sim
