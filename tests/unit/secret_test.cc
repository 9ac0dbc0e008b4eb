// The stack's shared secret (common/secret.h): a new file is 64 hex digits of fresh randomness,
// mode 0600; reading trims whitespace and refuses what cannot be a token, a guessable one and
// a file others may read or write.
#include "common/secret.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace hetero {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir() {
  fs::path dir =
      fs::temp_directory_path() /
      ("hetero-secret-test-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
       "-" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void write_text(const fs::path& p, const std::string& text,
                fs::perms mode = fs::perms::owner_read | fs::perms::owner_write) {
  std::ofstream(p) << text;
  fs::permissions(p, mode);
}

TEST(Secret, NewFileIsFreshHexWithOwnerOnlyMode) {
  const fs::path dir = temp_dir();
  const std::string a = (dir / "a").string(), b = (dir / "b").string();
  write_text(a, "an old secret\n");
  ::chmod(a.c_str(), 0644);
  ASSERT_TRUE(write_new_secret_file(a).is_ok());  // replaces what was there
  ASSERT_TRUE(write_new_secret_file(b).is_ok());
  for (const std::string& path : {a, b}) {
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u) << path;
    auto secret = read_secret_file(path);
    ASSERT_TRUE(secret.is_ok()) << secret.status().to_string();
    EXPECT_EQ(secret->size(), 64u);
    EXPECT_EQ(secret->find_first_not_of("0123456789abcdef"), std::string::npos) << *secret;
  }
  EXPECT_NE(read_secret_file(a).value(), read_secret_file(b).value());
  EXPECT_FALSE(fs::exists(a + ".tmp"));
  fs::remove_all(dir);
}

TEST(Secret, ReadingTrimsAndRefusesWhatIsNoToken) {
  const fs::path dir = temp_dir();
  const std::string token(32, 'k');
  write_text(dir / "ok", "  " + token + " \r\n\n");
  EXPECT_EQ(read_secret_file((dir / "ok").string()).value(), token);
  EXPECT_EQ(read_secret_file("").value(), "");  // no file: open
  EXPECT_EQ(read_secret_file((dir / "absent").string()).status().code(), Code::kNotFound);
  for (const std::string& bad :
       {std::string(""), std::string(" \n"),
        std::string(20, 'x') + " two words " + std::string(20, 'x'), std::string(5000, 'x'),
        std::string(40, 'x') + "\tinside", std::string("\x01\x02"),
        std::string(4096, 'x') + "\n\ny", std::string(4096, 'x') + std::string(70000, ' ')}) {
    write_text(dir / "bad", bad);
    EXPECT_EQ(read_secret_file((dir / "bad").string()).status().code(), Code::kInvalidArgument)
        << bad.substr(0, 20);
  }
  fs::remove_all(dir);
}

// Issue 50, finding 8: a one-character secret, or a world-readable file, was accepted silently.
TEST(Secret, AGuessableSecretOrAnExposedFileIsRefusedSayingWhy) {
  const fs::path dir = temp_dir();
  write_text(dir / "short", "x");
  auto r = read_secret_file((dir / "short").string());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find("32"), std::string::npos) << r.status().message();
  write_text(dir / "short31", std::string(31, 'k'));
  EXPECT_FALSE(read_secret_file((dir / "short31").string()).is_ok());
  for (fs::perms extra : {fs::perms::others_read, fs::perms::group_read, fs::perms::group_write,
                          fs::perms::others_write}) {
    write_text(dir / "open", std::string(64, 'a'),
               fs::perms::owner_read | fs::perms::owner_write | extra);
    auto o = read_secret_file((dir / "open").string());
    EXPECT_EQ(o.status().code(), Code::kInvalidArgument);
    EXPECT_NE(o.status().message().find("chmod 600"), std::string::npos) << o.status().message();
  }
  write_text(dir / "ro", std::string(64, 'a'), fs::perms::owner_read);
  EXPECT_TRUE(read_secret_file((dir / "ro").string()).is_ok());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace hetero
