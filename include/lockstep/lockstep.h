#pragma once

/// \file
/// Every public name of lockstep, in one include, except lockstep::from_c10d:
/// include <lockstep/c10d.h> for it, which brings c10d's headers
/// (torch/csrc/distributed) with it.

/// \namespace lockstep
/// Data-parallel training for LibTorch: DataParallel (one process, several
/// devices), DistributedDataParallel and FullyShardedDataParallel (one
/// process per rank, over a ProcessGroup), mixed precision (AutocastGuard,
/// GradScaler), SyncBatchNorm, communication hooks (comm_hooks, PowerSGD) and
/// the step timeline (timeline).

/// \mainpage Lockstep API reference
///
/// Lockstep is data-parallel training for LibTorch. Include
/// `<lockstep/lockstep.h>`, or the header of each part you use:
///
/// - lockstep::DataParallel (data_parallel.h): one process, one replica per
///   device.
/// - lockstep::DistributedDataParallel (distributed_data_parallel.h, its
///   options in distributed_options.h): one process per rank, gradients
///   averaged over the ranks while backward runs.
/// - lockstep::FullyShardedDataParallel (fully_sharded_data_parallel.h, its
///   options in sharding_options.h): parameters, gradients and optimizer
///   state split over the ranks.
/// - lockstep::ProcessGroup and lockstep::init_process_group
///   (process_group.h): the ranks and the collectives between them; backend.h
///   to write a backend of your own, c10d.h (not in lockstep.h) to wrap a
///   c10d process group.
/// - lockstep::AutocastGuard and lockstep::GradScaler (amp.h): mixed
///   precision.
/// - lockstep::save_safetensors and load_safetensors (safetensors.h):
///   weights in and out of LibTorch, in the format Python's safetensors and
///   Hugging Face use.
/// - lockstep::SyncBatchNorm (sync_batch_norm.h), communication hooks
///   (comm_hooks.h, powersgd.h) and the step timeline (timeline.h).
///
/// README.md says how to build, train and launch; docs/design.md how each
/// part works.

#include <lockstep/activation_checkpoint.h>
#include <lockstep/amp.h>
#include <lockstep/comm_hooks.h>
#include <lockstep/data_parallel.h>
#include <lockstep/data_parallel_options.h>
#include <lockstep/distributed_data_parallel.h>
#include <lockstep/distributed_options.h>
#include <lockstep/fully_sharded_data_parallel.h>
#include <lockstep/sharding_options.h>
#include <lockstep/powersgd.h>
#include <lockstep/process_group.h>
#include <lockstep/safetensors.h>
#include <lockstep/scatter_gather.h>
#include <lockstep/sync_batch_norm.h>
#include <lockstep/timeline.h>
#include <lockstep/version.h>
