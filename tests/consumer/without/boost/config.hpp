// Stands in front of Boost on the include path of the SQLite-only consumer (tests/consumer):
// every Boost header includes <boost/config.hpp> first, so any Boost include fails here.
#error "Boost is not available to this build: an idem built for SQLite alone must not need it"
