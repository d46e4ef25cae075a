// SPDX-License-Identifier: Apache-2.0
/// \file ep_layout.cuh
/// \brief Umbrella header of ep-layout: the byte layouts of ep's symmetric buffer.
///
/// Include this (or a single header) from host C++17, nvcc or NVRTC code. Everything lives in namespace `ep_layout`.
#pragma once

#include "buffer_composition.cuh"
#include "buffer_layout.cuh"
#include "config.cuh"
#include "math.cuh"
#include "token_layout.cuh"
#include "version.cuh"
#include "workspace_layout.cuh"
