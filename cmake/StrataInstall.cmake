# Installs the library, its public headers and a CMake package config so that
# a C++ trainer can `find_package(strata)` and link `strata::strata`.
include(CMakePackageConfigHelpers)

install(TARGETS strata EXPORT strataTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/strata DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h")
install(FILES ${PROJECT_BINARY_DIR}/include/strata/version.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/strata)
install(EXPORT strataTargets NAMESPACE strata::
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/strata)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/strataConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/strataConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/strata)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/strataConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/strataConfig.cmake
              ${PROJECT_BINARY_DIR}/strataConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/strata)
