from .extents import (
    ExtentMap,
    ExtentReader,
    build_extent_map,
    load_extent_map,
    read_files,
    verify_extent_map,
)
