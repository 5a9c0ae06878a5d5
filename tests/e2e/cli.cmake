# docs/CLI.md, the reference of every command and flag, against `tandem help --markdown` (what
# the flags' definitions give) and against every command's --help.
add_test(NAME e2e_cli_doc COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/cli_doc.sh $<TARGET_FILE:tandem_cli> ${CMAKE_SOURCE_DIR})
set_tests_properties(e2e_cli_doc PROPERTIES TIMEOUT 60)
