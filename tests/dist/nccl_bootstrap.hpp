// One NCCL communicator for the processes of a ring test or benchmark, without MPI: RANK and
// WORLD_SIZE (and LOCAL_RANK, default RANK) come from the environment, as torchrun or
// tools/ring_gpu_run.sh set them; rank 0 writes the ncclUniqueId to FM_NCCL_ID_FILE and the
// others wait for it (atomic rename, 120 s limit).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>

namespace fmdist {

struct Comm {
  int rank = 0, world = 1, device = 0;
  ncclComm_t comm = nullptr;
};

inline int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

inline void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string(what) + ": " + ncclGetErrorString(r));
}

inline Comm init_comm() {
  Comm c;
  c.rank = env_int("RANK", 0);
  c.world = env_int("WORLD_SIZE", 1);
  c.device = env_int("LOCAL_RANK", c.rank);
  if (cudaSetDevice(c.device) != cudaSuccess) throw std::runtime_error("cudaSetDevice failed");
  const char* file = std::getenv("FM_NCCL_ID_FILE");
  const std::string path = file ? file : "/tmp/flashmonoid-nccl-id";
  ncclUniqueId id;
  if (c.rank == 0) {
    check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    const std::string tmp = path + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "wb");
    if (!f || std::fwrite(&id, sizeof id, 1, f) != 1) throw std::runtime_error("cannot write " + tmp);
    std::fclose(f);
    std::rename(tmp.c_str(), path.c_str());
  } else {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    FILE* f = nullptr;
    while (!(f = std::fopen(path.c_str(), "rb"))) {
      if (std::chrono::steady_clock::now() > until) throw std::runtime_error("no NCCL id at " + path);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (std::fread(&id, sizeof id, 1, f) != 1) throw std::runtime_error("short NCCL id in " + path);
    std::fclose(f);
  }
  check_nccl(ncclCommInitRank(&c.comm, c.world, id, c.rank), "ncclCommInitRank");
  return c;
}

}  // namespace fmdist
