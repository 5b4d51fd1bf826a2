// The C boundary between dflash-collective (Rust) and PyTorch's c10d (C++).
//
// Every entry point returns 0 on success and 1 on failure; on failure
// `*error` is a malloc'd copy of the C++ exception's text (or null when even
// that allocation failed), which Rust copies and hands back to
// `dflash_c10d_free_error`. No C++ exception crosses this boundary: each body
// runs inside `guarded`, which catches everything.
//
// Objects: a `dflash_c10d_store` owns one reference to a TCPStore server; a
// `dflash_c10d_group` owns one c10d Backend (ProcessGroupGloo, or
// ProcessGroupNCCL when compiled with USE_C10D_NCCL) built over a PrefixStore.

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#ifdef USE_C10D_NCCL
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

struct dflash_c10d_store {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

struct dflash_c10d_group {
  c10::intrusive_ptr<c10d::Backend> backend;
  bool is_nccl;
};

namespace {

// Backend codes shared with src/ffi.rs.
constexpr int kBackendGloo = 0;
constexpr int kBackendNccl = 1;

void set_error(char** error, const char* message) noexcept {
  if (error == nullptr) {
    return;
  }
  const std::size_t length = std::strlen(message);
  char* copy = static_cast<char*>(std::malloc(length + 1));
  if (copy != nullptr) {
    std::memcpy(copy, message, length + 1);
  }
  *error = copy;
}

// Runs `body`, turning any exception into an error string. c10::Error (and
// c10d's DistError, its subclass) is reported without its C++ backtrace.
template <typename Body>
int guarded(char** error, Body&& body) noexcept {
  if (error != nullptr) {
    *error = nullptr;
  }
  try {
    body();
    return 0;
  } catch (const c10::Error& exception) {
    set_error(error, exception.what_without_backtrace());
  } catch (const std::exception& exception) {
    set_error(error, exception.what());
  } catch (...) {
    set_error(error, "unknown c++ exception");
  }
  return 1;
}

// Waits for one collective. For NCCL, Work::wait only orders the current CUDA
// stream after the collective; the API promises "blocks until done", so the
// stream is synchronised as well.
void wait_for(
    const dflash_c10d_group& group,
    const c10::intrusive_ptr<c10d::Work>& work,
    const at::Tensor& tensor) {
  work->wait();
#ifdef USE_C10D_NCCL
  if (group.is_nccl) {
    c10::cuda::getCurrentCUDAStream(tensor.device().index()).synchronize();
  }
#else
  (void)group;
  (void)tensor;
#endif
}

}  // namespace

extern "C" {

void dflash_c10d_free_error(char* error) {
  std::free(error);
}

// Hosts a TCPStore server on the already bound, listening socket
// `listen_fd` (bound to `port`); the store takes the socket over and closes
// it when destroyed.
int dflash_c10d_store_host(
    const char* host,
    int listen_fd,
    std::uint16_t port,
    std::int64_t timeout_ms,
    dflash_c10d_store** out,
    std::uint16_t* out_port,
    char** error) {
  return guarded(error, [&] {
    c10d::TCPStoreOptions options;
    options.port = port;
    options.isServer = true;
    options.numWorkers = std::nullopt;
    options.waitWorkers = false;
    options.timeout = std::chrono::milliseconds(timeout_ms);
    options.masterListenFd = listen_fd;
    auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), options);
    const std::uint16_t bound_port = store->getPort();
    *out = new dflash_c10d_store{std::move(store)};
    *out_port = bound_port;
  });
}

void dflash_c10d_store_free(dflash_c10d_store* store) {
  try {
    delete store;
  } catch (...) {
    // A destructor that throws has nowhere to report to; never abort.
  }
}

// Joins a group: a PrefixStore(prefix) over `local_store` when given, else
// over a new TCPStore client of store_host:store_port; then the backend's
// constructor, which rendezvouses with the other ranks (up to the timeout).
int dflash_c10d_group_new(
    const char* store_host,
    std::uint16_t store_port,
    dflash_c10d_store* local_store,
    const char* prefix,
    int rank,
    int world_size,
    const char* interface_host,
    std::int64_t timeout_ms,
    int backend,
    dflash_c10d_group** out,
    char** error) {
  return guarded(error, [&] {
    const auto timeout = std::chrono::milliseconds(timeout_ms);
    TORCH_CHECK(world_size > 0, "world size ", world_size, " must be positive");
    TORCH_CHECK(
        rank >= 0 && rank < world_size,
        "rank ", rank, " is outside world size ", world_size);

    c10::intrusive_ptr<c10d::Store> base_store;
    if (local_store != nullptr) {
      base_store = local_store->store;
    } else {
      c10d::TCPStoreOptions options;
      options.port = store_port;
      options.isServer = false;
      options.waitWorkers = false;
      options.timeout = timeout;
      base_store =
          c10::make_intrusive<c10d::TCPStore>(std::string(store_host), options);
    }
    auto group_store =
        c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), base_store);

    if (backend == kBackendGloo) {
      auto options = c10d::ProcessGroupGloo::Options::create(timeout);
      options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForHostname(
              std::string(interface_host)));
      auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(
          group_store, rank, world_size, options);
      *out = new dflash_c10d_group{std::move(group), false};
    } else if (backend == kBackendNccl) {
#ifdef USE_C10D_NCCL
      auto options = c10d::ProcessGroupNCCL::Options::create();
      options->timeout = timeout;
      auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          group_store, rank, world_size, options);
      *out = new dflash_c10d_group{std::move(group), true};
#else
      TORCH_CHECK(false, "built without feature nccl");
#endif
    } else {
      TORCH_CHECK(false, "unknown backend code ", backend);
    }
  });
}

// Destroys a group. For Gloo this waits for the group's worker threads, so
// a collective stuck on a dead or stopped peer holds it up to the timeout:
// Rust calls this on a detached thread.
void dflash_c10d_group_free(dflash_c10d_group* group) {
  try {
    delete group;
  } catch (...) {
    // See dflash_c10d_store_free.
  }
}

// `tensor` is tch's `at::Tensor*` (torch-sys's `C_tensor`).
int dflash_c10d_all_reduce_sum(
    dflash_c10d_group* group,
    void* tensor,
    char** error) {
  return guarded(error, [&] {
    auto& target = *static_cast<at::Tensor*>(tensor);
    std::vector<at::Tensor> tensors{target};
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    auto work = group->backend->allreduce(tensors, options);
    wait_for(*group, work, target);
  });
}

int dflash_c10d_broadcast(
    dflash_c10d_group* group,
    void* tensor,
    int root,
    char** error) {
  return guarded(error, [&] {
    auto& target = *static_cast<at::Tensor*>(tensor);
    std::vector<at::Tensor> tensors{target};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    options.rootTensor = 0;
    auto work = group->backend->broadcast(tensors, options);
    wait_for(*group, work, target);
  });
}

int dflash_c10d_barrier(dflash_c10d_group* group, char** error) {
  return guarded(error, [&] {
    auto work = group->backend->barrier(c10d::BarrierOptions());
    work->wait();
  });
}

}  // extern "C"
