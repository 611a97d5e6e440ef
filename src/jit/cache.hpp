// JIT on-disk cache of compiled kernels (docs/jit.md): 64-bit FNV-1a keys, one file per key,
// written to a temporary name and renamed into place, with a header (magic, key, length, checksum)
// so a corrupt or truncated file is detected, deleted and never returned. Thread- and process-safe.
#pragma once
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace encore::jit {

// FNV-1a 64, incremental. add() of a field also hashes its length, so ("ab","c") != ("a","bc").
class Hasher {
 public:
  Hasher& add_bytes(const void* data, size_t n);
  Hasher& add(std::string_view s);
  Hasher& add(uint64_t v);
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;  // FNV-1a 64 offset basis
};
uint64_t fnv1a64(const void* data, size_t n);
std::string hex64(uint64_t v);

// The resolved configuration: ENCORE_JIT (0 / off = off, 1 / auto / on = auto, 2 / always = every
// shape; unset = kDefault: auto, but a graph capture that would need a kernel not yet loaded records
// the ahead-of-time kernel instead of failing), ENCORE_JIT_CACHE_DIR (default
// $XDG_CACHE_HOME/encore/jit, else $HOME/.cache/encore/jit; empty = memory only).
enum class JitMode { kOff, kAuto, kAlways, kDefault };
JitMode mode_from_env();
std::string default_cache_dir();

struct CacheStats {
  int64_t files = 0;
  int64_t bytes = 0;
};

class DiskCache {
 public:
  explicit DiskCache(std::string dir);
  const std::string& dir() const { return dir_; }
  // The payload stored under `key`, or nullopt (missing, or corrupt: then deleted). `name` is a
  // readable prefix of the file name (the kernel), not part of the identity.
  std::optional<std::vector<char>> load(std::string_view name, uint64_t key);
  // Writes atomically (temp file + rename). False when the directory is not writable: the first
  // such failure prints one line to stderr and the cache then stays memory-only.
  bool store(std::string_view name, uint64_t key, const std::vector<char>& payload);
  bool writable() const;
  std::string path_for(std::string_view name, uint64_t key) const;
  CacheStats stats() const;  // cache files (encore-*.cubin) in dir

 private:
  std::string dir_;
  mutable std::mutex mu_;
  bool disabled_ = false;  // a write failed: memory only from now on
};

// File format, little-endian: magic "ENCJIT01", u64 key, u64 payload length, u64 FNV-1a of the
// payload, u64 FNV-1a of the preceding 32 bytes; then the payload.
constexpr size_t kCacheHeaderBytes = 40;
std::vector<char> encode_cache_file(uint64_t key, const std::vector<char>& payload);
std::optional<std::vector<char>> decode_cache_file(uint64_t key, const std::vector<char>& file);

}  // namespace encore::jit
