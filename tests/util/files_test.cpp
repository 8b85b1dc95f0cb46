// src/util/files.h: remove_tree (rm -rf without std::filesystem::remove_all) and
// read_whole_file.

#include "util/files.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <string>

namespace paratrain {
namespace testing {
namespace {

bool exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

TEST(Files, RemoveTreeRemovesNestedDirectoriesButNotLinkTargets) {
  const std::string root = "/tmp/" + unique_token("rmtree");
  const std::string outside = root + "-outside";
  ASSERT_EQ(::mkdir(root.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((root + "/a").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((root + "/a/b").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(outside.c_str(), 0755), 0);
  std::ofstream(root + "/a/b/file") << "x";
  std::ofstream(outside + "/kept") << "y";
  ASSERT_EQ(::symlink(outside.c_str(), (root + "/a/link").c_str()), 0);

  EXPECT_EQ(detail::remove_tree(root), "");
  EXPECT_FALSE(exists(root));
  EXPECT_TRUE(exists(outside + "/kept")) << "the link's target was emptied";
  EXPECT_EQ(detail::remove_tree(outside), "");
  EXPECT_FALSE(exists(outside));
  EXPECT_EQ(detail::remove_tree(root), "") << "a missing path is no error";
}

TEST(Files, RemoveTreeSaysWhatItCouldNotRemove) {
  // A path through a regular file: neither missing nor removable.
  const std::string file = "/tmp/" + unique_token("rmtree-file");
  std::ofstream(file) << "x";
  const std::string error = detail::remove_tree(file + "/below");
  EXPECT_NE(error.find(file + "/below: Not a directory"), std::string::npos) << error;
  EXPECT_EQ(detail::remove_tree(file), "");
  EXPECT_FALSE(exists(file));
}

TEST(Files, ReadWholeFileReadsEveryByteOrSaysWhyNot) {
  const std::string root = "/tmp/" + unique_token("readfile");
  ASSERT_EQ(::mkdir(root.c_str(), 0755), 0);
  std::string bytes(200000, 'a');
  bytes[0] = '\0';  // binary
  bytes.back() = 'z';
  std::ofstream(root + "/f", std::ios::binary) << bytes;
  std::ofstream(root + "/empty");
  EXPECT_EQ(detail::read_whole_file(root + "/f", "the test file"), bytes);
  EXPECT_EQ(detail::read_whole_file(root + "/empty", "the test file"), "");
  // /proc's files report size 0 and hold more.
  EXPECT_NE(detail::read_whole_file("/proc/self/status", "the test file").find("Pid:"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { detail::read_whole_file(root + "/missing", "the manifest"); }),
            "cannot read the manifest " + root + "/missing: No such file or directory");
  EXPECT_EQ(error_of([&] { detail::read_whole_file(root, "the manifest"); }),
            "cannot read the manifest " + root + ": it is a directory");
  // A FIFO with no writer: refused at once, not waited on.
  ASSERT_EQ(::mkfifo((root + "/fifo").c_str(), 0600), 0);
  EXPECT_EQ(error_of([&] { detail::read_whole_file(root + "/fifo", "the manifest"); }),
            "cannot read the manifest " + root + "/fifo: it is not a regular file");
  EXPECT_EQ(detail::remove_tree(root), "");
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
