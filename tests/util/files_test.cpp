// remove_tree (src/util/files.h): rm -rf without std::filesystem::remove_all.

#include "util/files.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>

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

}  // namespace
}  // namespace testing
}  // namespace paratrain
