// paratrain train's reading of the library's messages: the option fields they name become flags,
// and nothing else changes (values, paths, plain words).

#include "train_options.h"

#include <gtest/gtest.h>

#include <string>

namespace paratrain {
namespace cli {
namespace {

using train_detail::in_flags;

TEST(FlagWords, FieldsBecomeFlags) {
  EXPECT_EQ(in_flags("checkpoint_every needs checkpoint_dir"),
            "--checkpoint-every needs --checkpoint-dir");
  EXPECT_EQ(in_flags("zero works across DDP's ranks: add strategy ddp (got strategy single)"),
            "--zero works across DDP's ranks: add --strategy ddp (got --strategy single)");
  EXPECT_EQ(in_flags("the replicas diverged at step 4 (check_replicas)"),
            "the replicas diverged at step 4 (--check-replicas)");
  // "set" a switch is "add" its flag; "set" an option with a value is "give" it.
  EXPECT_EQ(in_flags("none was loaded; set start_fresh_if_damaged to start from step 0"),
            "none was loaded; add --start-fresh-if-damaged to start from step 0");
  EXPECT_EQ(in_flags("start as many ranks, or set elastic to reshard it"),
            "start as many ranks, or start it with `paratrain launch --nnodes MIN:MAX ...` to "
            "reshard it");
  EXPECT_EQ(in_flags("reset zero"), "reset --zero");  // "set" only as a word
}

TEST(FlagWords, ValuesPathsAndPlainWordsStay) {
  // A quoted value stays as the user gave it.
  EXPECT_EQ(in_flags("zero_checkpoint is 'zero': use consolidated or sharded"),
            "--zero-checkpoint is 'zero': use consolidated or sharded");
  // Words of a path are not options, whatever they are called, nor an option level's parts.
  EXPECT_EQ(in_flags("every checkpoint in /data/keep/epochs is damaged"),
            "every checkpoint in /data/keep/epochs is damaged");
  EXPECT_EQ(in_flags("checkpoint resume/ckpt-0000000002.json was made by 1 ranks"),
            "checkpoint resume/ckpt-0000000002.json was made by 1 ranks");
  EXPECT_EQ(in_flags("cannot read amp.toml (keep)"), "cannot read amp.toml (--keep)");
  EXPECT_EQ(in_flags("amp O2:bf16"), "--amp O2:bf16");
  EXPECT_EQ(in_flags("add zero."), "add --zero.");  // the end of a sentence is no path
}

}  // namespace
}  // namespace cli
}  // namespace paratrain
