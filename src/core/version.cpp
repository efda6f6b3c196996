// indexcp::version(): the library's version, from the generated indexcp/version.hpp.
#include "indexcp/version.hpp"

namespace indexcp {

const char* version() noexcept { return INDEXCP_VERSION_STRING; }

}  // namespace indexcp
