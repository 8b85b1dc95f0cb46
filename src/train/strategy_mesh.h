// Internal: what the fsdp strategy's two forms share. Plain FSDP and a device mesh without
// pipeline stages are FsdpStrategy (strategy_fsdp.cpp); a mesh with pp above 1 is a pipeline whose
// stages are sharded and split the same way (strategy_fsdp_pipeline.cpp).
#pragma once

#include "strategy.h"

#include "paratrain/parallel/device_mesh.h"
#include "paratrain/parallel/fully_sharded_data_parallel.h"
#include "paratrain/parallel/tensor_parallel.h"

#include <memory>
#include <optional>

namespace paratrain::train_internal {

/// Sharded gradients: every rank must agree to skip a step (PyTorch's ShardedGradScaler).
amp::AmpOptions sharded_scaler(const TrainerOptions& o);

/// The mesh and what tensor parallelism split, made before FSDP wraps the model.
struct MeshParts {
  std::unique_ptr<DeviceMesh> mesh;  // null: plain FSDP over the whole group
  TensorParallelLayout layout;
  bool loss_parallel = false;
  const dist::ProcessGroupPtr& tp() const { return (*mesh)["tp"]; }
};

/// The mesh of TrainerOptions::mesh, with the whole model split over its "tp" (a gpt() model).
MeshParts make_mesh(const TrainerOptions& o, const torch::nn::Sequential& model);
/// The fsdp options with HSDP's replicate group when the mesh has one.
FsdpOptions mesh_fsdp_options(const TrainerOptions& o, const MeshParts& parts);

/// Refuses a checkpoint without sharded state (another strategy's), naming the one that saved it.
void check_saved_by_fsdp(const CheckpointState& s, const nlohmann::json& meta);

/// The next validation batch of a strategy whose forward is a collective: the ranks' shares may
/// differ by a batch, so while any rank has one left, the ranks without one run their last batch
/// again with an empty target (not counted).
std::optional<data::Batch> next_val_batch_in_step(data::DataLoader& loader,
                                                  std::optional<data::Batch>& last,
                                                  const dist::ProcessGroupPtr& pg,
                                                  torch::Device device);

/// The fsdp strategy on a mesh with pipeline stages (pp above 1).
std::unique_ptr<TrainStrategy> make_fsdp_pipeline(const TrainerOptions& options,
                                                  torch::nn::Sequential model);

}  // namespace paratrain::train_internal
