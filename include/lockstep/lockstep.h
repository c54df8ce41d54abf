#pragma once

/// Every public name of lockstep.
#include <lockstep/data_parallel.h>
#include <lockstep/distributed.h>
#include <lockstep/distributed_data_parallel.h>
#include <lockstep/reducer.h>
#include <lockstep/scatter_gather.h>
