# Fails unless README.md links every page under docs/ (DOCS_DIR): the README is the door.
file(READ "${README}" readme)
file(GLOB pages RELATIVE "${DOCS_DIR}" "${DOCS_DIR}/*.md")
foreach(page IN LISTS pages)
  string(FIND "${readme}" "](docs/${page})" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "README.md does not link docs/${page}")
  endif()
endforeach()
