# The installed package as a C++ team uses it: this build installed into a fresh prefix, the
# examples/ projects configured with find_package(Tandem) and built against it, then run: one
# worker step by step against plain PyTorch (reference_train.py, .venv-hf), and under the
# installed `tandem launch` against one worker. The setup test installs and builds (ccache keeps
# rebuilds quick); the others need it (a CTest fixture).
set(_pkg ${CMAKE_CURRENT_SOURCE_DIR}/package)
set(_pkg_work ${CMAKE_BINARY_DIR}/package-test)
get_filename_component(_torch_prefix "${Torch_DIR}" DIRECTORY)  # torch.utils.cmake_prefix_path
set(_pkg_ccache "")
if(CCACHE_PROGRAM)
  set(_pkg_ccache "${CCACHE_PROGRAM}")
endif()

add_test(NAME package_install_examples
         COMMAND ${_pkg}/install_examples.sh ${CMAKE_BINARY_DIR} ${_pkg_work} ${CMAKE_SOURCE_DIR} ${_torch_prefix}
                 ${CMAKE_COMMAND} ${CMAKE_GENERATOR} ${CMAKE_CXX_COMPILER} "${_pkg_ccache}")
set_tests_properties(package_install_examples PROPERTIES FIXTURES_SETUP tandem_package TIMEOUT 600 PROCESSORS 2)

foreach(_ex resnet_engine custom_loop_ddp plugin)
  add_test(NAME package_${_ex} COMMAND ${_pkg}/${_ex}.sh ${_pkg_work} ${CMAKE_SOURCE_DIR})
  set_tests_properties(package_${_ex} PROPERTIES FIXTURES_REQUIRED tandem_package TIMEOUT 300 PROCESSORS 2)
endforeach()
