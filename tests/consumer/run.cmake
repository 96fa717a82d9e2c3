# Installs the built idem into a fresh prefix, then configures, builds and runs
# tests/consumer against it with find_package(idem CONFIG), as a user outside the tree would.
#   cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DWORK_DIR=... [-DCXX_COMPILER=...] [-DBUILD_TYPE=...]
#         [-DCXX_FLAGS=...] [-DSQLITE_ONLY=ON -DSANITIZE=...]
# With SQLITE_ONLY it builds and installs idem afresh with every optional part off (SANITIZE:
# the IDEM_SANITIZE to build it with) and checks the consumer needs neither Boost, libpq nor
# gRPC.
#         -P run.cmake
foreach(var BUILD_DIR SOURCE_DIR WORK_DIR)
  if(NOT ${var})
    message(FATAL_ERROR "run.cmake needs -D${var}=...")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message(STATUS "${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${err}")
  endif()
endfunction()

if(NOT BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()
set(compiler)
if(CXX_COMPILER)
  set(compiler -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
endif()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
set(sqlite_only)
if(SQLITE_ONLY)
  # A fresh build of the library alone, from the same sources: every optional part off, with
  # Boost and libpq hidden behind tests/consumer/without, then installed.
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/idem -G Ninja -DCMAKE_BUILD_TYPE=${BUILD_TYPE}
      -DIDEM_ASIO=OFF -DIDEM_HTTP=OFF -DIDEM_PG=OFF -DIDEM_GRPC=OFF -DIDEM_TESTS=OFF -DIDEM_DEMO=OFF -DIDEM_FUZZ=OFF
      "-DIDEM_SANITIZE=${SANITIZE}"
      "-DCMAKE_CXX_FLAGS=-I${SOURCE_DIR}/tests/consumer/without"
      ${compiler})
  run(${CMAKE_COMMAND} --build ${WORK_DIR}/idem)
  set(BUILD_DIR ${WORK_DIR}/idem)
  set(sqlite_only -DIDEM_CONSUMER_SQLITE_ONLY=ON)
endif()
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
if(EXISTS ${prefix}/include/idem/internal OR EXISTS ${prefix}/include/idem/sim OR
   EXISTS ${prefix}/include/idem/test_control.hpp)
  message(FATAL_ERROR "internal, simulator or test_control headers were installed")
endif()
if(SQLITE_ONLY AND (EXISTS ${prefix}/include/idem/asio.hpp OR EXISTS ${prefix}/include/idem/pg_store.hpp
                    OR EXISTS ${prefix}/include/idem/grpc.hpp))
  message(FATAL_ERROR "an idem built for SQLite alone installed the headers of parts it left out")
endif()
if(SQLITE_ONLY)
  # A library built without the suite carries no switch that plants a bug.
  file(GLOB archives ${prefix}/lib*/libidem.a)
  if(NOT archives)
    message(FATAL_ERROR "no libidem.a under ${prefix}")
  endif()
  execute_process(COMMAND nm -C ${archives} OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "nm failed on ${archives}")
  endif()
  if(symbols MATCHES "test_control")
    message(FATAL_ERROR "the installed libidem.a has test_control's switches")
  endif()
  if(NOT symbols MATCHES "SqliteStore")
    message(FATAL_ERROR "nm found no SqliteStore in ${archives}: the check above saw nothing")
  endif()
endif()
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build -G Ninja
    -DCMAKE_BUILD_TYPE=${BUILD_TYPE} -DCMAKE_PREFIX_PATH=${prefix} "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}"
    ${compiler} ${sqlite_only})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/blocking_consumer)
if(NOT SQLITE_ONLY)
  run(${WORK_DIR}/build/coroutine_consumer)
  run(${WORK_DIR}/build/http_consumer)
endif()
file(REMOVE_RECURSE ${WORK_DIR})
