# qwen4exp_kernel_sources(<var> <role>): the csrc/kernel_sources.txt entries of <role> ("kernel",
# "simt", "cpu" or "cpu_threads") as absolute paths, in <var>. That file is the one list of the library's sources;
# setup.py reads it too.
function(qwen4exp_kernel_sources var role)
  set(listing ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/../csrc/kernel_sources.txt)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${listing})
  file(STRINGS ${listing} lines REGEX "^${role} ")
  set(paths)
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "^${role} +([^ #]+).*$" "\\1" path "${line}")
    list(APPEND paths ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/../csrc/${path})
  endforeach()
  set(${var} ${paths} PARENT_SCOPE)
endfunction()
