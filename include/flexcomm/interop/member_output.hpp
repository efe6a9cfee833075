// What a rank prints while train_ensemble runs its part: a member's replicas and the producers
// print nothing (the member's first rank speaks for its replicas: trainer::reports()), and where
// several members share one terminal, each line a member prints starts with "member m: ", so that
// their progress and test lines say whose they are.
//
// The prefix is written in this thread, as the text is printed: printf (through `stdout`, which
// glibc lets a program reassign) and std::cout (its buffer swapped for one writing into the same
// FILE) go through one FILE that prefixes and writes to file descriptor 1. Their order stays, and
// nothing is left in a pipe when the job ends or aborts.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <iostream>
#include <optional>
#include <streambuf>
#include <string>

namespace flexcomm::interop {

// How a rank's stdout reads while its part runs.
enum class output {
  plain,     // as the program prints it
  quiet,     // to /dev/null: a member's replicas, the producers
  prefixed,  // each line starts with the prefix: a member's first rank, where there are several
};

namespace detail {
// std::cout's characters into a C FILE, in order with what printf writes there.
class file_buffer final : public std::streambuf {
 public:
  explicit file_buffer(FILE* to) : to_(to) {}

 protected:
  int_type overflow(int_type c) override {
    if (traits_type::eq_int_type(c, traits_type::eof())) return traits_type::not_eof(c);
    return std::fputc(traits_type::to_char_type(c), to_) == EOF ? traits_type::eof() : c;
  }
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    return static_cast<std::streamsize>(std::fwrite(s, 1, static_cast<std::size_t>(n), to_));
  }
  int sync() override { return std::fflush(to_) == 0 ? 0 : -1; }

 private:
  FILE* to_;
};
}  // namespace detail

class member_output {
 public:
  member_output(output how, std::string prefix) : how_(how), prefix_(std::move(prefix)) { start(); }
  member_output(const member_output&) = delete;
  member_output& operator=(const member_output&) = delete;
  ~member_output() { stop(); }

  // The program's own stdout for a while (the aggregator's report), then back to `how`.
  void pause() { stop(); }
  void resume() { start(); }

 private:
  static void flush() {
    std::cout.flush();
    std::fflush(stdout);
  }

  void start() {
    if (how_ == output::quiet && saved_fd_ < 0) {
      flush();
      const int null = ::open("/dev/null", O_WRONLY);
      if (null < 0) return;  // the prints stay: not worth failing a run over
      saved_fd_ = ::dup(STDOUT_FILENO);
      if (saved_fd_ >= 0) ::dup2(null, STDOUT_FILENO);
      ::close(null);
    } else if (how_ == output::prefixed && prefixed_ == nullptr) {
      flush();
      cookie_io_functions_t io{};
      io.write = &member_output::write_prefixed;
      prefixed_ = ::fopencookie(this, "w", io);
      if (prefixed_ == nullptr) return;  // unprefixed, then
      std::setvbuf(prefixed_, nullptr, ::isatty(STDOUT_FILENO) ? _IOLBF : _IOFBF, BUFSIZ);
      program_stdout_ = stdout;
      stdout = prefixed_;
      cout_buffer_.emplace(prefixed_);
      program_cout_ = std::cout.rdbuf(&*cout_buffer_);
    }
  }

  void stop() {
    if (saved_fd_ >= 0) {
      flush();
      ::dup2(saved_fd_, STDOUT_FILENO);
      ::close(saved_fd_);
      saved_fd_ = -1;
    }
    if (prefixed_ != nullptr) {
      flush();
      std::cout.rdbuf(program_cout_);
      cout_buffer_.reset();
      stdout = program_stdout_;
      std::fclose(prefixed_);
      prefixed_ = nullptr;
    }
  }

  // The FILE's output: the prefix before each line's first character, then the text, to fd 1.
  static ssize_t write_prefixed(void* self, const char* data, std::size_t size) {
    auto& out = *static_cast<member_output*>(self);
    std::string text;
    text.reserve(size + out.prefix_.size());
    for (std::size_t i = 0; i < size; ++i) {
      const char c = data[i];
      if (out.line_starts_ && c != '\n' && c != '\r') text += out.prefix_;
      text += c;
      out.line_starts_ = c == '\n' || c == '\r';
    }
    for (std::size_t done = 0; done < text.size();) {
      const ssize_t n = ::write(STDOUT_FILENO, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return -1;
      done += static_cast<std::size_t>(n);
    }
    return static_cast<ssize_t>(size);
  }

  output how_;
  std::string prefix_;
  int saved_fd_ = -1;             // quiet: the program's fd 1
  FILE* prefixed_ = nullptr;      // prefixed: the FILE printf and std::cout write to
  FILE* program_stdout_ = nullptr;
  std::streambuf* program_cout_ = nullptr;
  std::optional<detail::file_buffer> cout_buffer_;
  bool line_starts_ = true;
};

}  // namespace flexcomm::interop
