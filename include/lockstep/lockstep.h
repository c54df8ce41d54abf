#pragma once

/// Every public name of lockstep.
#include <lockstep/data_parallel.h>
#include <lockstep/runtime.h>
#include <lockstep/scatter_gather.h>
