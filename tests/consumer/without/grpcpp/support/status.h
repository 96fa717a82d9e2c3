// Stands in front of gRPC on the include path of the SQLite-only consumer (tests/consumer).
#error "gRPC is not available to this build: an idem built for SQLite alone must not need it"
