// Stands in front of protobuf on the include path of the SQLite-only consumer (tests/consumer).
#error "protobuf is not available to this build: an idem built for SQLite alone must not need it"
