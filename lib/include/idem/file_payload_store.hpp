// idem — a PayloadStore over a directory of files, for bodies too large to keep inline in
// the record (Options::inline_body_limit).
#pragma once

#include <string>

#include "idem/options.hpp"

namespace idem {

// Each body is one file, named by the key's short hash and a digest of the body, written
// whole to a temporary name, synced, then renamed into place and the directory synced: a
// reference the record holds always names a complete, durable file.
// Files are not removed when their record is purged: delete files older than the TTL plus
// a margin (a body is written just before its record completes), e.g. a daily
// find DIR -mmin +N -delete, if the directory must not grow.
// Thread-safety: safe for concurrent use, by several processes too.
class FilePayloadStore final : public PayloadStore {
 public:
  // Creates `directory` if it does not exist. Throws StoreError if it cannot.
  explicit FilePayloadStore(std::string directory);

  // Throws StoreError if the file cannot be written and synced.
  std::string put(const KeyId& id, const std::string& body) override;
  // Throws StoreError for a reference this store did not make or a file that is gone.
  std::string get(const std::string& ref) override;

 private:
  std::string directory_;
};

}  // namespace idem
