# ctest labels of the GoogleTest cases, applied when ctest reads the discovered test list
# (tests/CMakeLists.txt appends this file to TEST_INCLUDE_FILES after gtest_discover_tests):
#
#   unit          one process, under 2 s: run with PARATRAIN_TEST_UNIT=1, under which
#                 run_process and start_process (test_util.h) fail the test, so a test that starts
#                 processes cannot keep this label;
#   multiprocess  starts processes: ranks, launchers, Python references, compilers;
#   slow          over 10 s, or one process over 2 s, on the developers' machines;
#   gpu           needs a CUDA device (skips, saying so, without one);
#   cpu-kernels   its numbers depend on which CPU kernels oneDNN and OpenBLAS pick; CI runs these
#                 a second time with the instruction set capped to AVX2 (suffix @avx2);
#   one-leg       independent of the libtorch version: CI runs it in the first leg only.
#
# A test is `unit` when its suite is listed in paratrain_unit_suites or its name in
# paratrain_unit_tests (measured with strace: no execve or fork beyond its own), unless it is
# slow; every other test is `multiprocess`.

cmake_policy(PUSH)
cmake_policy(SET CMP0057 NEW)  # if(... IN_LIST ...) in ctest's own reading of this file

set(paratrain_unit_suites
    AdaptImages Autocast ConvertSyncBatchNorm CpuKernels DataParallel DeviceList Devices
    DistributedSampler Files FindProgram GradScaler Image ImageList Join Loader MixedPrecision
    Pipeline PipelineBalance PipelineSchedule RankDiscovery Routes Safetensors SocketStore Trace
    Trainer TuneScheduler TuneSearcher TuneSpace TuneStorage)
set(paratrain_unit_tests
    BadInput.NewGroupRanks Checkpoint.OptimizerStateRoundTripsBitwise
    Checkpoint.RngStateRestoresTheSameDraws FashionMNIST.ReadsDebiansFiles
    FashionMNIST.MissingFilesSayWhatToInstall ImageFolder.FollowsTorchvisionsRules
    ImageFolder.BadFoldersAreNamed ImageFolder.BadFilesAreNamedOrSkipped LRSchedule.BadOptions
    SyncBatchNorm.WithoutAGroupItIsBatchNorm SyncBatchNorm.BadInputIsNamed
    TensorBoard.MaskedCrc32cMatchesTheStandardCheckValue TensorBoard.UnwritableDirectoryIsNamed
    Transforms.RandomResizedCropFollowsTorchvisionsRules Transforms.BadInputIsRefused
    TunePostgres.BadUrlsAreOneLine Tuner.AshaOnFunctionTrialsStopsTheWorstAndKeepsTheBest
    Tuner.HyperbandPausesAndResumesFunctionTrials Tuner.BadInputIsRefusedBeforeAnythingRuns
    Zero.WorldOfOneIsThePlainOptimizer Zero.RefusesWhatCannotBeSharded
    Zoo.ResNetParameterCountsEqualTorchvision Zoo.CustomHeadAndFrozenBackbone Zoo.NotAWeightsFile)
# Over 10 s (multiprocess) or over 2 s (one process), and their seconds in ctest's times here
# (the same order).
set(paratrain_slow_tests
    MixedPrecision.EveryOptLevelTrainsLikeFp32 Slurm.SbatchRunsSrunTasksAndLaunch
    MultiHost.ElasticJobTakesInALateHost Resume.BadInput
    ImageFolder.CliMakesAFolderAndTrainsOnItWithDdp Train.CustomHeadOnTorchvisionWeights
    MultiHost.ElasticTrainingLosesNoSampleAcrossAMembershipChange Train.MixedPrecisionDdpExample
    Train.BadInput MultiHost.ElasticJobContinuesWithoutADeadHost
    Resume.ShardedZeroCheckpointResumesOnAnotherWorldSize Resume.DdpOnMpi
    Rendezvous.TwoNodesClaimingOneNodeRankAreNamed Zoo.ResNetParameterCountsEqualTorchvision)
set(paratrain_slow_costs 112 21 20 19 18 18 15 14 14 14 13 12 11 3)
# Independent of libtorch's version (pure logic, or other libraries): first leg only. Everything
# that touches libtorch's API (stores, process groups, backends, autocast, kernels, the launcher,
# the rendezvous, checkpoints, the model zoo) runs on both legs.
set(paratrain_one_leg_suites
    DeviceList Files FindProgram RankDiscovery Trace TuneScheduler TuneSearcher TuneSpace
    TuneStorage TunePostgres TuneReport)
# A long accuracy comparison: its fp32 run alone takes minutes in the second leg, and the
# per-step comparison MixedPrecision.EveryOptLevelStepsLikeFp32 runs in both (the test explains).
set(paratrain_one_leg_tests MixedPrecision.EveryOptLevelTrainsLikeFp32)

# The cases CI runs a second time with the instruction set capped (tests/CMakeLists.txt, suffix
# @avx2), as an older CPU would run them.
set(paratrain_isa_cap_environment
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 OPENBLAS_CORETYPE=Haswell)
set(paratrain_capped "")
foreach(test IN LISTS paratrain_tests_avx2_TESTS)
  string(REGEX REPLACE "@avx2$" "" base "${test}")
  list(APPEND paratrain_capped "${base}")
endforeach()

foreach(test IN LISTS paratrain_tests_TESTS paratrain_tests_avx2_TESTS)
  string(REGEX REPLACE "\\..*" "" suite "${test}")
  string(REGEX REPLACE "  # GetParam.*" "" bare "${test}")
  string(REGEX REPLACE "@avx2$" "" bare "${bare}")
  set(environment "")
  if(test MATCHES "@avx2$")
    set(environment ${paratrain_isa_cap_environment})
  endif()
  set(labels "")
  if(suite STREQUAL "Gpu")
    list(APPEND labels gpu)
  endif()
  set(slow OFF)
  if(bare IN_LIST paratrain_slow_tests)
    set(slow ON)
    list(APPEND labels slow)
  endif()
  set(unit OFF)
  if(suite IN_LIST paratrain_unit_suites OR bare IN_LIST paratrain_unit_tests)
    set(unit ON)
  endif()
  if(unit AND NOT slow)
    list(APPEND labels unit)
    list(APPEND environment PARATRAIN_TEST_UNIT=1)
  elseif(NOT unit AND NOT suite STREQUAL "Gpu")
    list(APPEND labels multiprocess)
  endif()
  if(suite IN_LIST paratrain_one_leg_suites OR bare IN_LIST paratrain_one_leg_tests)
    list(APPEND labels one-leg)
  endif()
  if(test MATCHES "@avx2$")
    list(APPEND labels cpu-kernels isa-avx2)
  elseif(test IN_LIST paratrain_capped)
    list(APPEND labels cpu-kernels)
  endif()
  set_tests_properties("${test}" PROPERTIES LABELS "${labels}" ENVIRONMENT "${environment}")
  # ctest -j starts the costliest tests first; without a previous run's times it would start them
  # in file order, and the longest could start last and run alone.
  list(FIND paratrain_slow_tests "${bare}" slow_index)
  if(slow_index GREATER_EQUAL 0)
    list(GET paratrain_slow_costs ${slow_index} cost)
    set_tests_properties("${test}" PROPERTIES COST ${cost})
  endif()
endforeach()
cmake_policy(POP)
