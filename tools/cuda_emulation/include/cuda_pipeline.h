// The CUDA header cuda_pipeline.h, as the emulation provides it (../cuda_emulation.h).
#pragma once
#include "../cuda_emulation.h"
