#pragma once

// Umbrella header: everything public in paratrain.

#include "paratrain/version.h"

#include "paratrain/amp/autocast.h"         // amp::Autocast
#include "paratrain/amp/grad_scaler.h"      // amp::GradScaler
#include "paratrain/amp/mixed_precision.h"  // amp::MixedPrecision, opt levels O0-O3

#include "paratrain/data/dataset.h"              // Dataset, ImageFolder, ImageList, TensorDataset
#include "paratrain/data/device_prefetcher.h"    // DevicePrefetcher
#include "paratrain/data/distributed_sampler.h"  // DistributedSampler
#include "paratrain/data/fashion_mnist.h"        // FashionMNIST
#include "paratrain/data/image.h"                // read_image, decode_image, encode_*
#include "paratrain/data/loader.h"               // DataLoader, LoaderOptions, samplers
#include "paratrain/data/make_image_folder.h"    // write_image_folder
#include "paratrain/data/tokens.h"               // TokenDataset, write_tokens (nanoGPT, llm.c)
#include "paratrain/data/transforms.h"           // transforms::Resize, RandomResizedCrop, ...

#include "paratrain/comm/devices.h"        // local_device, check_device_exists
#include "paratrain/comm/init.h"           // init_process_group, InitOptions
#include "paratrain/comm/process_group.h"  // ProcessGroup, Work, ReduceOp, CollectiveError
#include "paratrain/launch/env.h"          // RankInfo, discover_rank_info
#include "paratrain/launch/launch.h"       // launch, LaunchOptions (paratrain launch)
#include "paratrain/launch/spawn.h"        // spawn
#include "paratrain/store/host_address.h"  // route_source_address, is_loopback_name

#include "paratrain/io/checkpoint.h"          // Checkpoint, optimizer_state, rng_state
#include "paratrain/io/safetensors.h"         // save/load_safetensors, module_state
#include "paratrain/io/safetensors_shards.h"  // save/load_safetensors_shards
#include "paratrain/io/tensorboard.h"         // tensorboard::SummaryWriter (event files)
#include "paratrain/io/torch_load.h"          // load_torch_state_dict, load_weights
#include "paratrain/models/conv1d.h"          // models::Conv1D (GPT-2's projection)
#include "paratrain/models/generate.h"        // models::generate (greedy, top-k)
#include "paratrain/models/gpt.h"             // models::gpt, GptOptions, presets
#include "paratrain/models/gpt_parallel.h"    // models::gpt_parallelize_plan (tensor parallel)
#include "paratrain/models/gpt_pretrained.h"  // Hugging Face GPT-2 directories
#include "paratrain/models/registry.h"        // models::make
#include "paratrain/optim/fused.h"            // optim::FusedAdam, FusedAdamW, FusedSGD
#include "paratrain/parallel/activation_checkpoint.h"  // checkpoint, apply_activation_checkpointing
#include "paratrain/parallel/comm_hooks.h"             // CommHook, fp16/bf16 compression
#include "paratrain/parallel/data_parallel.h"          // DataParallel
#include "paratrain/parallel/device_mesh.h"            // DeviceMesh, init_device_mesh
#include "paratrain/parallel/distributed_data_parallel.h"  // DistributedDataParallel, DDPOptions
#include "paratrain/parallel/fsdp_checkpoint.h"  // save/load_sharded_checkpoint, consolidate
#include "paratrain/parallel/fully_sharded_data_parallel.h"  // FullyShardedDataParallel (FSDP2)
#include "paratrain/parallel/join.h"                         // Join (uneven inputs)
#include "paratrain/parallel/module_hooks.h"  // register_forward_hook, call_with_hooks
#include "paratrain/parallel/pipeline.h"      // pipeline::Pipeline, DistributedPipeline, schedules
#include "paratrain/parallel/sync_batchnorm.h"   // SyncBatchNorm, convert_sync_batchnorm
#include "paratrain/parallel/tensor_parallel.h"  // parallelize_module, Colwise/RowwiseParallel
#include "paratrain/parallel/threads.h"          // set_blas_threads
#include "paratrain/parallel/zero_redundancy_optimizer.h"  // ZeroRedundancyOptimizer
#include "paratrain/train/lr_schedule.h"  // LRSchedule: step, multistep, cosine, warm-up
#include "paratrain/train/trainer.h"      // Trainer, TrainerOptions, make_optimizer
#include "paratrain/util/allocator.h"     // cpu::keep_freed_memory, glibc keeps freed tensors
#include "paratrain/util/cpu_kernels.h"   // cpu::ensure_usable_kernels, CPU kernel workarounds
#include "paratrain/util/trace.h"         // trace::Tracer, Span (Chrome traces)
