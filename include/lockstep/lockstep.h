#pragma once

/// Every public name of lockstep.
#include <lockstep/amp.h>
#include <lockstep/c10d.h>
#include <lockstep/comm_hooks.h>
#include <lockstep/data_parallel.h>
#include <lockstep/data_parallel_options.h>
#include <lockstep/distributed_data_parallel.h>
#include <lockstep/fully_sharded_data_parallel.h>
#include <lockstep/powersgd.h>
#include <lockstep/process_group.h>
#include <lockstep/scatter_gather.h>
#include <lockstep/sync_batch_norm.h>
#include <lockstep/timeline.h>
