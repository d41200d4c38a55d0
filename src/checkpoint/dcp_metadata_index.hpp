// The index tensortier's writer puts before the pickle of a .metadata (dcp_metadata.hpp): the
// Metadata's contents in a binary form a reader decodes without running the pickle.
#pragma once

#include <string>
#include <string_view>

#include "tensortier/checkpoint/dcp_metadata.hpp"

namespace tensortier {

// The index of `md`, whose pickle (without its PROTO opcode) is `body`.
std::string EncodeDcpMetadataIndex(const DcpMetadataContents& md, std::string_view body);

}  // namespace tensortier
