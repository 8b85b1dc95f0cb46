# Which tests are which: read by tests/CMakeLists.txt (how the cases become ctest tests) and by
# tests/labels.cmake (their labels and environment, when ctest reads the test list).

set(paratrain_unit_suites
    AdaptImages Allocator Args Autocast ConvertSyncBatchNorm CpuKernels DataParallel DeviceList
    Devices DistributedSampler Files FindProgram FlagWords FusedOptimizer GradScaler Image ImageList
    Offload
    Join Loader
    MixedPrecision
    Pipeline PipelineBalance PipelineSchedule RankDiscovery RendezvousPolicy RendezvousRounds Routes
    Safetensors SocketStore TokenDataset
    GptPretrained Trace
    Trainer TuneScheduler TuneSearcher TuneSpace TuneStorage)
set(paratrain_unit_tests
    BadInput.NewGroupRanks BadInput.BrokenPipeIsAnErrorNotASignal BadInput.ReservedPointToPointTag
    Checkpoint.OptimizerStateRoundTripsBitwise Checkpoint.FileNamesGiveTheirStep
    Checkpoint.EveryCheckpointDamagedFailsAndDeletesNothing
    Checkpoint.RotationPrunesEveryRanksFilesAndKeepsNewerCheckpoints
    FsdpCheckpoint.ConsolidateNeverWritesOverACheckpoint
    Checkpoint.RngStateRestoresTheSameDraws FashionMNIST.ReadsDebiansFiles
    SlurmHostList.BadListsAreOneLine SlurmHostList.PlacementFromTheAllocationsVariables
    FashionMNIST.MissingFilesSayWhatToInstall ImageFolder.FollowsTorchvisionsRules
    ImageFolder.BadFoldersAreNamed ImageFolder.BadFilesAreNamedOrSkipped LRSchedule.BadOptions
    SyncBatchNorm.WithoutAGroupItIsBatchNorm SyncBatchNorm.BadInputIsNamed
    TensorBoard.MaskedCrc32cMatchesTheStandardCheckValue TensorBoard.UnwritableDirectoryIsNamed
    Transforms.RandomResizedCropFollowsTorchvisionsRules Transforms.BadInputIsRefused
    TunePostgres.BadUrlsAreOneLine Tuner.AshaOnFunctionTrialsStopsTheWorstAndKeepsTheBest
    Tuner.HyperbandPausesAndResumesFunctionTrials Tuner.BadInputIsRefusedBeforeAnythingRuns
    Tuner.BohbLearnsFromAshaRungsWithoutWaiting
    Zero.WorldOfOneIsThePlainOptimizer Zero.RefusesWhatCannotBeSharded
    Zoo.ResNetParameterCountsEqualTorchvision Zoo.CustomHeadAndFrozenBackbone Zoo.NotAWeightsFile
    Data.TokenizeWritesByteTokens Data.TokenizeNamesABadInputPathBeforeWritingAnything
    Gpt.NamesFollowHuggingFace Gpt.BadShapesAndInputsAreOneLine Gpt.CausalMaskHidesTheFuture
    Gpt.TrainsOnARepeatingSequence ActivationCheckpoint.GradientsAreBitwiseEqualWithDropout
    ActivationCheckpoint.KeepsNamesAndRefusesUnknownChildren Fsdp.RefusesWhatCannotBeSharded
    Fsdp.KeptBlocksAreFreedAfterBackward
    FsdpCheckpoint.WorldOfOneRoundTripsBitwise FsdpCheckpoint.BadDirectoriesAreOneLine
    Launch.ProgramWithoutExecuteBitIsNamed Launch.ErrorsNameTheCommandOnce)
# The slow tests, over 10 s (multiprocess) or over 2 s (one process), with their seconds in
# ctest's times here (its COST): each says so beside itself in its source, on its TEST line
# (`TEST(Resume, BadInput) {  // ctest: slow 24`) or, for a case of a parameterized suite, on a
# line of its own naming the case (`// ctest: slow 30 Benchmarks/BenchSmoke.WritesJsonRows/cluster`).
# Read afresh each time ctest reads the test list; which slow cases run alone is settled when
# CMake configures (a new annotation takes a reconfigure to run its test alone).
set(paratrain_slow_tests "")
set(paratrain_slow_costs "")
file(GLOB_RECURSE paratrain_test_sources "${CMAKE_CURRENT_LIST_DIR}/*.cpp")
foreach(source IN LISTS paratrain_test_sources)
  file(STRINGS "${source}" annotated REGEX "^[ \t]*(TEST(_F|_P)?\\(.*)?// ctest: ")
  foreach(line IN LISTS annotated)
    if(line MATCHES "^[ \t]*// ctest: slow ([0-9]+) ([A-Za-z0-9_/.]+)$")
      list(APPEND paratrain_slow_tests "${CMAKE_MATCH_2}")
      list(APPEND paratrain_slow_costs ${CMAKE_MATCH_1})
    elseif(line MATCHES "^TEST(_F)?\\(([A-Za-z0-9_]+), ([A-Za-z0-9_]+)\\) {  // ctest: slow ([0-9]+)$")
      list(APPEND paratrain_slow_tests "${CMAKE_MATCH_2}.${CMAKE_MATCH_3}")
      list(APPEND paratrain_slow_costs ${CMAKE_MATCH_4})
    else()
      message(FATAL_ERROR "${source}: '${line}' is not a test's annotation: write "
                          "'TEST(Suite, Name) {  // ctest: slow SECONDS' or "
                          "'// ctest: slow SECONDS Prefix/Suite.Name/case'")
    endif()
  endforeach()
endforeach()
# The parameterized suites (PREFIX/SUITE): ctest runs their cases of both legs as one test, and
# each of their first-leg mpi cases alone (tests/CMakeLists.txt).
set(paratrain_parameterized_suites
    Backends/Collectives Cases/DdpEquivalence Cases/PipelineDistributed
    Cases/SyncBatchNormEquivalence Cases/ZeroEquivalence Cases/JoinUneven
    Cases/FsdpEquivalence Cases/TensorParallelEquivalence)
# Cases that scripts select by name (scripts/sanitize.sh), which therefore run as ctest tests of
# their own rather than inside their suite's.
set(paratrain_named_tests Train.CustomResNetFinetuneExample BadInput.MpiCollectiveTimeout)
# The tests CI runs in leg 1 and in the official leg (libtorch 1.13 and the wheel's 2.x): those of
# code that calls libtorch where 1.13 and 2.x differ, namely c10d (stores, process groups and
# their engines, Work, timeouts), autograd functions and hooks (DDP, SyncBatchNorm, ZeRO, Join,
# pipelines, DataParallel, FSDP), autocast and the CPU kernels, serialization (checkpoints,
# PyTorch's and torchvision's files), the installed CMake package, and the Hugging Face GPT-2
# tests (HfGpt2: against transformers, which the official leg's environment holds; leg 1 leaves
# them to it). Every other test runs in leg 1 only (label one-leg): argument checking, the
# launcher, the rendezvous and multi-host jobs (paratrain_launch calls no libtorch beyond c10's
# error type; the workers' DDP is the DDP suites'), the tuner, data readers, TensorBoard, Slurm,
# the benchmarks, the CLI's end-to-end runs; so do the mpi cases of the parameterized suites but
# one each (their gloo cases run in both, the mpi engine's own tests too).
set(paratrain_both_legs_suites
    Addresses Allocator Autocast BadInput Checkpoint Collectives ConvertSyncBatchNorm
    CpuKernels FusedOptimizer FusedOptimizerPyTorch Offload
    DataParallel Ddp DdpEquivalence Devices Example InitMethods Join JoinUneven
    MixedPrecision Pipeline PipelineBalance PipelineDistributed PipelineSchedule
    Routes SocketStore Spawn SyncBatchNorm SyncBatchNormEquivalence Trainer
    WorldOfOne Zero ZeroEquivalence Zoo GradScaler Fsdp FsdpEquivalence ActivationCheckpoint
    Gpt GptPretrained FsdpCheckpoint HfGpt2 TensorParallel TensorParallelEquivalence)
set(paratrain_both_legs_tests
    Train.MainJobShortened Train.ModelParallelResNet50Example Resume.SingleProcess
    Resume.DdpOnGloo Resume.AmpO1AndO2Bf16 Resume.ShardedZeroCheckpointResumesOnAnotherWorldSize
    Transforms.DecodersAndTransformsMatchTorchvision
    Cases/DdpEquivalence.MatchesSingleProcess/plain_mpi_2ranks
    Cases/ZeroEquivalence.MatchesUnshardedOptimizer/adam_mpi_2ranks
    Cases/FsdpEquivalence.MatchesSingleProcess/adam_mpi_2ranks
    Cases/SyncBatchNormEquivalence.MatchesWholeBatch/ddp_mpi_2ranks
    Cases/JoinUneven.NeitherHangsNorDropsGradients/ddp_syncbn_zero_mpi_3ranks
    Cases/PipelineDistributed.MatchesSingleProcess/gpipe_3_stages_mpi)
# In the suites above, but leg 1 only: the long accuracy comparison (its fp32 run alone takes
# minutes on a 2.x libtorch, and the per-step comparison MixedPrecision.EveryOptLevelStepsLikeFp32
# runs in both; the test explains).
set(paratrain_one_leg_tests MixedPrecision.EveryOptLevelTrainsLikeFp32)

# The cases CI runs a second time with the instruction set capped (tests/CMakeLists.txt, suffix
# @avx2), as an older CPU would run them.
set(paratrain_isa_cap_environment
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 OPENBLAS_CORETYPE=Haswell)
# The cases whose numbers depend on which CPU kernels run (bf16 autocast, oneDNN convolutions,
# BLAS), once more as a CPU with AVX2 and no AVX512 would run them: ctest names them NAME@avx2 and
# runs them with ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2 and OPENBLAS_CORETYPE=Haswell
# (tests/labels.cmake). A machine of either kind thus runs both. Not here: the multi-process bf16
# training tests (Train.MixedPrecisionUnderDdp, Resume.AmpO1AndO2Bf16), whose bf16 steps run 14x
# slower on libtorch 1.13's own kernels under the cap (62 s and 72 s): MixedPrecision.* and
# CpuKernels.* check that path.
set(paratrain_cpu_kernel_tests
    MixedPrecision.* Autocast.* GradScaler.* CpuKernels.* FusedOptimizer.* DataParallel.ResNetReplicas
    ConvertSyncBatchNorm.ResNetKeepsItsTensorsAndNames Zoo.TorchvisionWeightsGiveTheSameLogits
    Train.ModelParallelResNet50Example Gpt.MatchesAPyTorchReference
    Pipeline.GradientsEqualUnsplitModel Trainer.EveryInProcessStrategyMatchesOneProcess
    Cases/DdpEquivalence.MatchesSingleProcess/plain_gloo_2ranks
    Cases/SyncBatchNormEquivalence.MatchesWholeBatch/bn2d_uneven_gloo_2ranks)
