// The CUDA header cooperative_groups.h, as the emulation provides it (../cuda_emulation.h).
#pragma once
#include "../cuda_emulation.h"
