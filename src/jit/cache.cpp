// JIT on-disk cache: hashing, file format, atomic publish (docs/jit.md).
#include "jit/cache.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

namespace encore::jit {

Hasher& Hasher::add_bytes(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h_ ^= p[i];
    h_ *= 1099511628211ull;
  }
  return *this;
}
Hasher& Hasher::add(uint64_t v) {
  unsigned char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
  return add_bytes(b, 8);
}
Hasher& Hasher::add(std::string_view s) { return add(uint64_t(s.size())).add_bytes(s.data(), s.size()); }

uint64_t fnv1a64(const void* data, size_t n) { return Hasher().add_bytes(data, n).value(); }

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// On by default (auto, outside the AOT lists): on the H200 every JIT specialization outside the lists
// ran at least as fast as the ahead-of-time fallback (docs/jit.md, "Numbers"). Unknown values: off.
JitMode mode_from_env() {
  const char* e = std::getenv("ENCORE_JIT");
  if (e == nullptr || *e == '\0') return JitMode::kDefault;
  std::string v(e);
  if (v == "1" || v == "auto" || v == "on") return JitMode::kAuto;
  if (v == "2" || v == "always") return JitMode::kAlways;
  return JitMode::kOff;
}

std::string default_cache_dir() {
  if (const char* d = std::getenv("ENCORE_JIT_CACHE_DIR")) return d;  // "" = memory only
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/encore/jit";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/encore/jit";
  return "";
}

namespace {

void put64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>(v >> (8 * i));
}
uint64_t get64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}
constexpr char kMagic[8] = {'E', 'N', 'C', 'J', 'I', 'T', '0', '1'};

bool read_file(const std::string& path, std::vector<char>* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  out->assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  return !f.bad();
}

}  // namespace

std::vector<char> encode_cache_file(uint64_t key, const std::vector<char>& payload) {
  std::vector<char> f(kCacheHeaderBytes + payload.size());
  std::memcpy(f.data(), kMagic, 8);
  put64(f.data() + 8, key);
  put64(f.data() + 16, payload.size());
  put64(f.data() + 24, fnv1a64(payload.data(), payload.size()));
  put64(f.data() + 32, fnv1a64(f.data(), 32));
  if (!payload.empty()) std::memcpy(f.data() + kCacheHeaderBytes, payload.data(), payload.size());
  return f;
}

std::optional<std::vector<char>> decode_cache_file(uint64_t key, const std::vector<char>& f) {
  if (f.size() < kCacheHeaderBytes || std::memcmp(f.data(), kMagic, 8) != 0) return std::nullopt;
  if (get64(f.data() + 32) != fnv1a64(f.data(), 32) || get64(f.data() + 8) != key) return std::nullopt;
  const uint64_t n = get64(f.data() + 16);
  if (n != f.size() - kCacheHeaderBytes) return std::nullopt;  // truncated or padded
  std::vector<char> payload(f.begin() + kCacheHeaderBytes, f.end());
  if (fnv1a64(payload.data(), payload.size()) != get64(f.data() + 24)) return std::nullopt;
  return payload;
}

DiskCache::DiskCache(std::string dir) : dir_(std::move(dir)) {}

std::string DiskCache::path_for(std::string_view name, uint64_t key) const {
  return dir_ + "/encore-" + std::string(name) + "-" + hex64(key) + ".cubin";
}

bool DiskCache::writable() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !dir_.empty() && !disabled_;
}

std::optional<std::vector<char>> DiskCache::load(std::string_view name, uint64_t key) {
  if (dir_.empty()) return std::nullopt;
  const std::string path = path_for(name, key);
  std::vector<char> file;
  if (!read_file(path, &file)) return std::nullopt;
  auto payload = decode_cache_file(key, file);
  if (!payload) std::remove(path.c_str());  // corrupt or truncated: never loaded, recompiled by the caller
  return payload;
}

bool DiskCache::store(std::string_view name, uint64_t key, const std::vector<char>& payload) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (dir_.empty() || disabled_) return false;
  }
  static std::atomic<uint64_t> counter{0};
  const std::string path = path_for(name, key);
  const std::string tmp = dir_ + "/.tmp-" + std::to_string(::getpid()) + "-" +
                          hex64(std::hash<std::thread::id>()(std::this_thread::get_id())) + "-" +
                          std::to_string(counter++) + "-" + hex64(key);
  std::string why;
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  const std::vector<char> file = encode_cache_file(key, payload);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    why = std::strerror(errno);
  } else {
    size_t off = 0;
    while (off < file.size()) {
      ssize_t w = ::write(fd, file.data() + off, file.size() - off);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) break;
      off += size_t(w);
    }
    const bool ok = off == file.size() && ::fsync(fd) == 0;
    if (!ok) why = std::strerror(errno);
    ::close(fd);
    // rename is atomic: a concurrent reader sees the old file, none, or the whole new one; two
    // writers of one key write the same bytes, the last rename wins.
    if (ok && ::rename(tmp.c_str(), path.c_str()) == 0) return true;
    if (ok) why = std::strerror(errno);
    std::remove(tmp.c_str());
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!disabled_) {
    disabled_ = true;
    std::fprintf(stderr, "encore jit: cache directory '%s' is not writable (%s); kernels are cached in memory only\n",
                 dir_.c_str(), why.c_str());
  }
  return false;
}

CacheStats DiskCache::stats() const {
  CacheStats s;
  std::error_code ec;
  if (dir_.empty()) return s;
  for (auto it = std::filesystem::directory_iterator(dir_, ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n.rfind("encore-", 0) != 0 || n.size() < 6 || n.substr(n.size() - 6) != ".cubin") continue;
    std::error_code e2;
    const auto sz = it->file_size(e2);
    if (e2) continue;
    ++s.files;
    s.bytes += int64_t(sz);
  }
  return s;
}

}  // namespace encore::jit
