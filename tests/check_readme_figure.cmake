# The README's in-flight figure (docs/in-flight.svg) is what `idem-demo table --svg` draws
# today: regenerate it with `build/dev/demo/idem-demo table --svg /tmp/f && cp /tmp/f/in-flight.svg docs/`.
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${DEMO} table --svg ${WORK_DIR} RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "idem-demo table --svg failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files ${WORK_DIR}/in-flight.svg ${FIGURE}
                RESULT_VARIABLE differ)
if(NOT differ EQUAL 0)
  message(FATAL_ERROR "${FIGURE} differs from what idem-demo table --svg draws now")
endif()
