# Fails unless the page DOC (README.md or a page under docs/) shows the example file EXAMPLE
# verbatim: the compiled example and the one readers copy never drift apart.
file(READ "${DOC}" doc)
file(READ "${EXAMPLE}" example)
string(FIND "${doc}" "${example}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "${DOC} does not show ${EXAMPLE} verbatim; paste the file into it")
endif()
