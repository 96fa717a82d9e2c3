// Stands in front of libpq on the include path of the SQLite-only consumer (tests/consumer).
#error "libpq is not available to this build: an idem built for SQLite alone must not need it"
