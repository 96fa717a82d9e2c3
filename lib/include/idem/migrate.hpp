// idem — moving a store from SQLite to PostgreSQL (target idem::pg).
//
//   idem::PgStore pg("host=db1 dbname=payments", idem::PgOptions{.schema = "idem"});
//   idem::MigrationReport r = idem::migrate_sqlite_to_pg("keys.db", pg);
//
// The move, step by step: run the migration while the SQLite store still serves (it copies
// the bulk), stop the processes that write to the file, run it again (it copies what changed
// since), and start them on the PgStore. A run reads the file in short transactions, so
// the processes that still use it are not held up.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "idem/clock.hpp"
#include "idem/pg_store.hpp"

namespace idem {

// What a migration did. A rerun counts only what it did itself.
struct MigrationReport {
  std::size_t records_copied = 0;         // written to PostgreSQL: new there, or an earlier
                                          // copy brought up to date
  std::size_t records_unchanged = 0;      // already on PostgreSQL as they are on SQLite
  std::size_t records_skipped_newer = 0;  // on PostgreSQL at a higher token (reserved or taken
                                          // over there since): left as they are
  std::size_t records_expired = 0;        // past their expiry at the source's now: not copied
  std::size_t outbox_copied = 0;          // messages not yet delivered, written to PostgreSQL
  std::size_t outbox_skipped = 0;         // already on PostgreSQL: left as they are there
};

struct MigrationOptions {
  // Records (and then messages) read from the file and written to PostgreSQL in one
  // transaction each. Must be positive. Default: 256.
  std::size_t batch = 256;
  // The clock the SQLite store's times are on (its Coordinator's Options::clock): a record
  // whose expiry has passed at its now() is not copied. Default (null): a SystemClock.
  std::shared_ptr<Clock> clock{};
  // Called after each batch has committed, with the totals so far (progress for a long
  // run); may be empty. What it throws ends the migration there and propagates: the batches
  // committed stay, and a rerun completes the rest. Default: none.
  std::function<void(const MigrationReport&)> on_batch{};
};

// Copies the SqliteStore file `sqlite_file` into `to`:
//  - every record that still counts: completed within its TTL, released with progress
//    within its TTL from the operation's start, in progress within its lease, and in progress
//    with progress whatever its lease (the completer's); with its state, fingerprint, response
//    (status, headers, body byte for byte, body_ref unchanged: a PayloadStore must be shared
//    by the new nodes), recovery point, progress and stored request. Its times are moved onto
//    `to`'s clock (PgClock::database) as every PgStore write's are, so leases and TTLs end
//    when they would have; `to`'s PgOptions::local_clock should be the clock the SQLite
//    store's times came from.
//  - every outbox message not yet delivered (pending or parked), with its id, attempts,
//    due time and last error; delivered ones are not copied.
// Not copied: an application's own tables that local steps wrote (they live beside the
// store, not in it).
//
// Fencing: a record is copied with its SQLite token plus one, so a process that held it
// before the move (a zombie) can no longer complete, release, renew or record a step on
// PostgreSQL; once its lease ends, the next caller takes it over there, resuming from its
// progress, as after any crash.
//
// Reruns: each record is written only if PostgreSQL has none, or has one at a lower token, or
// an earlier copy at the same token that differs (the record changed on SQLite since: it
// completed, was released or renewed). A record reserved or taken over on PostgreSQL since
// (a higher token) is never overwritten, and a message already there is left as it is. So a
// rerun after a full run copies nothing, and a rerun after a failure or a stop midway (any
// committed batch stays) completes the copy without copying anything twice. An expired
// record is written only over an earlier copy of it, never anew. Keys written on both sides
// between two runs are a mistake: stop the SQLite writers before the last run.
//
// Returns what it did. Throws:
//   StoreError - the file or the database could not be used (busy, I/O, a lost
//                connection). Retryable: run it again.
//   idem::error(errc::invalid_argument) - `sqlite_file` does not exist, is not an SQLite
//                database, or is not an idem store; its schema is newer than this library's;
//                or options.batch is 0. Nothing was copied. Not retryable: fix the input.
// A store of an older schema is brought up to date in place first, as opening it with
// SqliteStore would.
//
// Thread-safety: may run while the file is in use by SqliteStores and `to` by Coordinators.
MigrationReport migrate_sqlite_to_pg(const std::string& sqlite_file, PgStore& to,
                                     const MigrationOptions& options = {});

}  // namespace idem
