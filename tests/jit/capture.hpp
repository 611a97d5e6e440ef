// Graph-capture helpers of the JIT GPU tests: an op run inside a stream capture (its status, the
// graph), a replay, and a non-blocking stream owned by the test.
#pragma once
#include <cuda_runtime.h>

#include <functional>
#include <string>

#include "encore/core/status.hpp"

namespace encore::test {

struct TestStream {
  cudaStream_t s = nullptr;
  TestStream() { cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); }
  ~TestStream() {
    if (s) cudaStreamDestroy(s);
  }
  TestStream(const TestStream&) = delete;
  TestStream& operator=(const TestStream&) = delete;
};

// op(s) inside a thread-local capture of `s`: op's status; the captured graph in *graph (the caller
// replays it), or destroyed when graph is null.
inline Status run_captured(cudaStream_t s, const std::function<Status(cudaStream_t)>& op, cudaGraph_t* graph = nullptr) {
  if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return Status::cuda_error("cudaStreamBeginCapture failed");
  const Status st = op(s);
  cudaGraph_t g = nullptr;
  if (cudaStreamEndCapture(s, &g) != cudaSuccess) return Status::cuda_error("cudaStreamEndCapture failed; the op said: " + st.to_string());
  if (graph) *graph = g;
  else if (g) cudaGraphDestroy(g);
  return st;
}

// Instantiates `graph`, launches it on `s`, waits, and destroys both.
inline Status replay(cudaGraph_t graph, cudaStream_t s) {
  cudaGraphExec_t exec = nullptr;
  cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
  if (e == cudaSuccess) e = cudaGraphLaunch(exec, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (exec) cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return e == cudaSuccess ? Status::ok() : Status::cuda_error(std::string("graph replay: ") + cudaGetErrorString(e));
}

}  // namespace encore::test
