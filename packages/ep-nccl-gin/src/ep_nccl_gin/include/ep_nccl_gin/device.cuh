// ep_nccl_gin/device.cuh: the device side of ep-nccl-gin, a small transport concept over one NCCL window.
//
// Kernels receive an `ep_nccl_gin::Context` by value (host: `DevComm.context_bytes(window)`) and build a
// `Transport` from it. The concept, shared with ep-core's ipc transport:
//
//   T*   sym_ptr(T* local_ptr, int peer)          load/store pointer of `peer`'s copy, or nullptr (not LSA)
//   void put(dst, src, nbytes, peer)              one-sided copy local src -> peer's dst (GIN)
//   void put_signal(dst, src, nbytes, peer, sig)  the same, then peer's signal `sig` += 1 once the data landed
//   void put_value(T* dst, T value, peer)         one-sided store of a value of <= 8 bytes (GIN)
//   void signal(peer, sig, add)                   peer's signal `sig` += add (GIN)
//   u64  read_signal(sig) / void wait(sig, least) this rank's signal `sig` (GIN)
//   bool try_wait(sig, least, timeout_cycles)     bounded wait: false on timeout (GIN)
//   void flush()                                  local completion of this thread's GIN puts (sources reusable)
//   void barrier(index)                           LSA barrier over the NVLink/P2P team, acquire-release
//
// Contracts:
// - Pointers passed as `local_ptr`, `dst` and `src` point into this rank's registered window
//   (`[ctx.base, ctx.base + ctx.num_bytes)`); peers are world ranks. Windows are symmetric: the same offset on
//   every rank.
// - GIN calls need a device communicator created with GIN (`DevComm.gin_available`); they construct an
//   `ncclGin` on `gin_context` each call (a few loads). Hot loops may hold `ncclGin` themselves.
// - `barrier(index)` needs `lsa_barrier_count > index` at `create_dev_comm`, and every thread of the cooperative
//   group (`ncclCoopCta` by default: the whole block) must call it.
// - Compile against the NCCL headers of the loaded library (`ep_nccl_gin.include_dirs()`): the layout of
//   ncclDevComm changes between NCCL releases.
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define EP_NCCL_GIN_DEVICE __device__ __forceinline__
#else
#define EP_NCCL_GIN_DEVICE inline
#endif

namespace ep_nccl_gin {

// Kernel argument. Host mirror: DevComm.context_bytes() packs [ncclDevComm | pad to 8 | window | base | bytes].
struct Context {
  ncclDevComm comm;    // from ncclDevCommCreate, by value
  ncclWindow_t window; // the registered window (a device pointer)
  char* base;          // this rank's local address of window offset 0
  std::uint64_t num_bytes;
};

static_assert(std::is_trivially_copyable<Context>::value, "Context is passed by value to kernels");
static_assert(alignof(ncclDevComm) <= 8, "Context packing on the host assumes ncclDevComm aligns to <= 8 bytes");
static_assert(offsetof(Context, window) == (sizeof(ncclDevComm) + 7) / 8 * 8, "host packing: window offset");
static_assert(offsetof(Context, base) == offsetof(Context, window) + 8, "host packing: base offset");
static_assert(offsetof(Context, num_bytes) == offsetof(Context, window) + 16, "host packing: num_bytes offset");
static_assert(sizeof(Context) == offsetof(Context, window) + 24, "host packing: total size");

#if defined(__CUDACC__)

class Transport {
 public:
  EP_NCCL_GIN_DEVICE explicit Transport(const Context& ctx, int gin_context = 0)
      : ctx_(ctx), gin_context_(gin_context) {}

  EP_NCCL_GIN_DEVICE int rank() const { return ctx_.comm.rank; }
  EP_NCCL_GIN_DEVICE int num_ranks() const { return ctx_.comm.nRanks; }
  EP_NCCL_GIN_DEVICE int lsa_rank() const { return ctx_.comm.lsaRank; }
  EP_NCCL_GIN_DEVICE int lsa_size() const { return ctx_.comm.lsaSize; }
  EP_NCCL_GIN_DEVICE const Context& context() const { return ctx_; }

  // Byte offset of a local window address.
  EP_NCCL_GIN_DEVICE std::size_t offset_of(const void* local_ptr) const {
    return static_cast<std::size_t>(static_cast<const char*>(local_ptr) - ctx_.base);
  }

  // Whether world rank `peer` is reachable by loads and stores (same LSA team).
  EP_NCCL_GIN_DEVICE bool is_lsa_peer(int peer) const {
    return ncclTeamRankIsMember(ncclTeamLsa(ctx_.comm), ncclTeamWorld(ctx_.comm), peer);
  }

  // `peer`'s address of what `local_ptr` is here, usable for loads/stores/TMA; nullptr when `peer` is not in
  // the LSA team (use put/put_signal then). sym_ptr(p, rank()) aliases p through NCCL's mapping.
  template <typename T>
  EP_NCCL_GIN_DEVICE T* sym_ptr(T* local_ptr, int peer) const {
    ncclTeam lsa = ncclTeamLsa(ctx_.comm);
    ncclTeam world = ncclTeamWorld(ctx_.comm);
    if (!ncclTeamRankIsMember(lsa, world, peer)) return nullptr;
    int lsa_peer = ncclTeamRankToTeam(lsa, world, peer);
    void* p = ncclGetLsaPointer(ctx_.window, offset_of(local_ptr), lsa_peer);
    return static_cast<T*>(p);
  }

  // ---- GIN (one-sided network operations) ----

  template <typename Coop = ncclCoopThread>
  EP_NCCL_GIN_DEVICE void put(void* dst, const void* src, std::size_t nbytes, int peer, Coop coop = Coop{}) const {
    ncclGin gin(ctx_.comm, gin_context_);
    gin.put(ncclTeamWorld(ctx_.comm), peer, ctx_.window, offset_of(dst), ctx_.window, offset_of(src), nbytes,
            ncclGin_None{}, ncclGin_None{}, coop);
  }

  template <typename Coop = ncclCoopThread>
  EP_NCCL_GIN_DEVICE void put_signal(void* dst, const void* src, std::size_t nbytes, int peer,
                                     ncclGinSignal_t signal_id, std::uint64_t add = 1, Coop coop = Coop{}) const {
    ncclGin gin(ctx_.comm, gin_context_);
    gin.put(ncclTeamWorld(ctx_.comm), peer, ctx_.window, offset_of(dst), ctx_.window, offset_of(src), nbytes,
            ncclGin_SignalAdd{signal_id, add}, ncclGin_None{}, coop);
  }

  template <typename T>
  EP_NCCL_GIN_DEVICE void put_value(T* dst, T value, int peer) const {
    static_assert(sizeof(T) <= 8, "put_value carries at most 8 bytes");
    ncclGin gin(ctx_.comm, gin_context_);
    gin.putValue(ncclTeamWorld(ctx_.comm), peer, ctx_.window, offset_of(dst), value);
  }

  EP_NCCL_GIN_DEVICE void signal(int peer, ncclGinSignal_t signal_id, std::uint64_t add = 1) const {
    ncclGin gin(ctx_.comm, gin_context_);
    gin.signal(ncclTeamWorld(ctx_.comm), peer, ncclGin_SignalAdd{signal_id, add});
  }

  EP_NCCL_GIN_DEVICE std::uint64_t read_signal(ncclGinSignal_t signal_id) const {
    ncclGin gin(ctx_.comm, gin_context_);
    return gin.readSignal(signal_id);
  }

  // Spin until this rank's signal reaches `least` (rolling comparison, 64 bits). Bound the wait by the caller's
  // timeout policy: poll read_signal() instead where a deadline is needed.
  EP_NCCL_GIN_DEVICE void wait(ncclGinSignal_t signal_id, std::uint64_t least) const {
    ncclGin gin(ctx_.comm, gin_context_);
    gin.waitSignal(ncclCoopThread{}, signal_id, least);
  }

  // Bounded wait: true once this rank's signal reaches `least` (rolling 64-bit comparison), false after
  // `timeout_cycles` of clock64() without it; the caller records the timeout and aborts cleanly.
  EP_NCCL_GIN_DEVICE bool try_wait(ncclGinSignal_t signal_id, std::uint64_t least,
                                   std::uint64_t timeout_cycles) const {
    ncclGin gin(ctx_.comm, gin_context_);
    const long long start = clock64();
    while (static_cast<std::int64_t>(gin.readSignal(signal_id) - least) < 0) {
      if (static_cast<std::uint64_t>(clock64() - start) > timeout_cycles) return false;
    }
    return true;
  }

  EP_NCCL_GIN_DEVICE void reset_signal(ncclGinSignal_t signal_id) const {
    ncclGin gin(ctx_.comm, gin_context_);
    gin.resetSignal(signal_id);
  }

  template <typename Coop = ncclCoopThread>
  EP_NCCL_GIN_DEVICE void flush(Coop coop = Coop{}) const {
    ncclGin gin(ctx_.comm, gin_context_);
    gin.flush(coop);
  }

  // ---- LSA barrier ----

  template <typename Coop = ncclCoopCta>
  EP_NCCL_GIN_DEVICE void barrier(std::uint32_t index, Coop coop = Coop{}) const {
    ncclLsaBarrierSession<Coop> session(coop, ctx_.comm, ncclTeamTagLsa{}, index);
    session.sync(coop, cuda::memory_order_acq_rel);
  }

 private:
  const Context& ctx_;
  int gin_context_;
};

#endif  // __CUDACC__

}  // namespace ep_nccl_gin
