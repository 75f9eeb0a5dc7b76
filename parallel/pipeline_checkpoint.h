// Pipeline checkpoints: a pipelined training run (parallel/pipeline.h) saved so that it
// continues exactly, and exported as one model. A pipeline rank holds only its stages, so
// each writes what it holds and no rank ever gathers the whole model; the stages' modules
// name their parameters as the whole model does (GPTStage: "transformer.h.7.attn.c_attn.weight"
// on the stage that holds block 7), so the files together are the model's state dict.
//
// A checkpoint is a folder:
//
//   stage-g<G>-<r>-of-<P>.safetensors  pipeline rank r's stages, written by the first replica
//                                      of that rank (data-parallel coordinate 0; the replicas
//                                      are equal); r and P written with five digits, as in
//                                      "stage-g3-00001-of-00002.safetensors". Tensors: each stage's state dict under the
//                                      whole model's names, and the optimizer's buffers per
//                                      parameter ("optim.<name>.<buffer>"). Metadata: each
//                                      parameter's optimizer step ("step.<name>"), the
//                                      optimizer's group sizes ("param_groups.<g>.size", which
//                                      differ between ranks), the names each stage holds in
//                                      order ("stage.<s>" = "name,name,..."), a second name
//                                      of one parameter ("tied.<alias>" = "<name>", when one
//                                      stage holds both ends of GPT's tied embedding; its
//                                      optimizer state is filed under <name>), and the rank's
//                                      random generator ("rng.seed", "rng.offset": the ranks
//                                      of a pipeline are seeded apart)
//   stage-g<G>-<r>-of-<P>-shard-<d>-of-<D>.safetensors
//                                      the same for stages sharded by FSDP
//                                      (PipelineOptions::shard) over data-parallel groups of
//                                      D > 1 ranks: each rank d of pipeline rank r's group
//                                      writes its rows of every parameter and of its optimizer
//                                      buffers (fsdp.h's cut, shard_rows), with the whole
//                                      shape as "shape.<name>"; buffers whole
//   index.safetensors                  no tensors. Metadata: "format" = "loom-pipeline-1",
//                                      the generation G, "pp" (P), "stages" (virtual stages in
//                                      all), "shards" (D, 1 for whole stages), the optimizer's type ("optimizer") and group
//                                      hyper-parameters ("param_groups.<g>.<field>"), the
//                                      schedule's state ("scheduler.<key>"), world rank 0's
//                                      generator ("rng.seed", "rng.offset", as a file
//                                      checkpoint holds it, layers/checkpoint.h) and the
//                                      caller's entries ("user.<key>")
//
// GPT's tied embedding is held twice, by stage 0 as "transformer.wte.weight" and by the last
// stage as "lm_head.weight" (the pipeline keeps the two copies equal): each file holds its
// stage's copy under that name and each stage loads its own copy back, which is also what
// nn::GPT::state_dict() lists under the two names.
//
// Saving: each writing rank writes its stage file (atomically, engine/serialization.h), a
// barrier over the whole world waits for all of them, then world rank 0 writes the index
// (atomically, hence last and whole) and removes every other generation's stage files, and a
// second barrier lets no rank run ahead of a checkpoint that is not finished. G counts the
// saves into the folder: a save killed at any point leaves the previous index naming the
// previous files, which are still there, so the previous checkpoint stays loadable, and the
// files of a save that never finished are found by no index and removed by the next save.
//
// Sharded and whole stages load into one another: a parameter's rows are put together from the
// shard files that hold them (parallel/checkpoint_files.h, copy_saved_rows), so a
// checkpoint saved with --fsdp at one data-parallel size loads sharded at another, or whole,
// and one of whole stages loads sharded.
//
// Loading: every rank, replicas included, reads the index and the stage files' headers, which
// list each stage's names; together, in stage order, they are the whole model's state-dict
// order. It then reads the files that hold what its own stages need, whatever pipeline saved
// them: another number of ranks, of stages per rank, or other cuts between the blocks (a name
// listed twice is taken once, from its first file). Before anything changes it checks the
// format, that every name its stages need is there with the same shape, and that each of its
// stages holds a run of the saved order (stage 0's from its start, the last stage's to its
// end), so that a checkpoint of a model with more blocks is not loaded in part; then it
// restores its stages, its optimizer (each parameter's state filed under its name, from the
// file that holds the parameter), the schedule, and its generator: the one its pipeline rank
// saved, or world rank 0's for a rank the saving pipeline did not have. Numbers are decimal
// text that reads back to the same double (or 64-bit integer), so a resumed run follows the
// same losses bit for bit on the same device and layout. No communication.
#pragma once

#include <map>
#include <string>

#include "../layers/optim/optimizer.h"
#include "../layers/optim/schedule.h"
#include "pipeline.h"

namespace loom::dist::pipeline {

// What a pipeline checkpoint saves and restores on one rank.
struct PipelineCheckpoint {
  Pipeline* pipeline = nullptr;  // this rank's stages
  // Every rank of every pipeline (the save's barriers, the generation's broadcast).
  ProcessGroup* world = nullptr;
  // This rank's data-parallel coordinate: the replicas of coordinate 0 write the stage files
  // (of a sharded stage, every rank of the first replica's shard group writes its rows).
  int replica = 0;
  optim::Optimizer* optimizer = nullptr;    // built on the stages' parameters; may be null
  optim::LRScheduler* scheduler = nullptr;  // may be null
  std::map<std::string, std::string> user;  // the caller's entries (saved; load returns them)
};

// Writes the checkpoint into the folder `dir` (created if missing). Every rank of the world
// calls it.
void save_pipeline_checkpoint(const std::string& dir, const PipelineCheckpoint& state);

// Restores this rank's stages, optimizer, schedule and generator from `dir`, saved by a
// pipeline of any layout over the same model, and returns the caller's entries. Every rank
// calls it; failures name the folder (or file) and what disagreed, and leave everything
// unchanged.
std::map<std::string, std::string> load_pipeline_checkpoint(const std::string& dir, const PipelineCheckpoint& state);

// The step a run resumed from a pipeline checkpoint goes on from. Its data position (epoch,
// batch, step) counts the batches of one pipeline, so it holds at any pipeline layout: `step`
// is returned. At another number of data-parallel pipelines an epoch has another number of
// steps: a checkpoint saved at an epoch's end goes on from that epoch's first step as this run
// counts them (epoch * steps_per_epoch), the schedule moved there. Saved within an epoch at
// another count, it is refused naming both counts.
int64_t resumed_pipeline_step(int64_t saved_pipelines, int64_t pipelines, int64_t epoch, int64_t batch, int64_t step,
                              int64_t steps_per_epoch, optim::LRScheduler& schedule);

// Writes the whole model's parameters of the checkpoint in `dir` to one safetensors file, in
// stage order under the model's names (for a GPT, what nn::GPT::state_dict() lists, tied
// names included), so nn::load_weights or PyTorch's load_file read it as a plain model. One
// process, no group.
void export_pipeline_checkpoint(const std::string& dir, const std::string& path);

}  // namespace loom::dist::pipeline
