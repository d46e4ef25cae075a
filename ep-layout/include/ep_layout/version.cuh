// SPDX-License-Identifier: Apache-2.0
/// \file version.cuh
/// \brief Version of the byte layouts (not of the Python package).
///
/// `EP_LAYOUT_VERSION_MAJOR` is bumped on ANY change of a byte: a field, an offset, an alignment, a region size or a
/// buffer composition. `EP_LAYOUT_VERSION_MINOR` is bumped for additions that move no existing byte (a new getter,
/// a new helper). JIT caches key on both; runtimes check that the major matches the one they were built against.
/// The Python mirror exposes the same numbers as `ep_layout.LAYOUT_VERSION`.
#pragma once

#define EP_LAYOUT_VERSION_MAJOR 1
#define EP_LAYOUT_VERSION_MINOR 0

/// Single integer for `#if` comparisons: major * 1000 + minor.
#define EP_LAYOUT_VERSION (EP_LAYOUT_VERSION_MAJOR * 1000 + EP_LAYOUT_VERSION_MINOR)
