// The SIMT emulator's scheduler (see runtime.h for what it provides and why).
//
// One launch at a time per process (a mutex): a launch runs its blocks one after another on the
// calling thread, so the running lane can be a plain global, which keeps threadIdx a single load.
// Each lane of a block is a fiber with its own stack; switching is a few instructions (x86-64
// assembly below) or ucontext elsewhere (and with QWEN4EXP_SIMT_UCONTEXT, which the self-test
// builds to keep that path tested). Under AddressSanitizer every switch is announced
// (__sanitizer_start/finish_switch_fiber), shared memory not handed out is poisoned, and stacks
// abandoned by a failed block are unpoisoned before reuse.
#include "runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define QWEN4EXP_SIMT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define QWEN4EXP_SIMT_ASAN 1
#endif
#endif
#if defined(QWEN4EXP_SIMT_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(__x86_64__) && !defined(QWEN4EXP_SIMT_UCONTEXT)
#define QWEN4EXP_SIMT_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

// ---- Errors (per OS thread, as the GPU runtimes keep them) -----------------------------------

namespace {

thread_local hipError_t last_error = hipSuccess;
thread_local std::string last_message;

hipError_t fail(hipError_t code, std::string message) {
  last_error = code;
  last_message = "simt: " + std::move(message);
  return code;
}

}  // namespace

hipError_t hipGetLastError() {
  const hipError_t error = last_error;
  last_error = hipSuccess;
  return error;
}

const char* hipGetErrorString(hipError_t error) {
  if (error != hipSuccess && !last_message.empty()) return last_message.c_str();
  switch (error) {
    case hipSuccess: return "no error";
    case hipErrorInvalidValue: return "invalid argument";
    case hipErrorInvalidConfiguration: return "invalid configuration argument";
    case hipErrorLaunchFailure: return "unspecified launch failure";
  }
  return "unknown error";
}

namespace qwen4exp {
namespace simt {

const LaneCoordinates* current_lane_coordinates = nullptr;

namespace {

// ---- Fibers -------------------------------------------------------------------------------------

#if defined(QWEN4EXP_SIMT_ASM_SWITCH)

#define QWEN4EXP_SIMT_STR2(x) #x
#define QWEN4EXP_SIMT_STR(x) QWEN4EXP_SIMT_STR2(x)
#define QWEN4EXP_SIMT_SYMBOL(name) \
  "qwen4exp_simt" QWEN4EXP_SIMT_STR(QWEN4EXP_SIMT_WAVE_SIZE) "_" name

// switch(save, load): pushes the callee-saved registers on the current stack, stores the stack
// pointer in *save, and pops the same from the stack at `load`. A new fiber's stack is laid out as
// if it had called switch from the trampoline, which then calls entry(arg) with entry in r12 and
// arg in rbx. The SSE and x87 control words are not switched (kernel code never changes them, and
// ldmxcsr/fldcw would be most of a switch's time): every lane runs in the launching thread's
// floating-point environment.
// clang-format off
extern "C" void qwen4exp_simt_switch(void** save, void* load) __asm__(QWEN4EXP_SIMT_SYMBOL("switch"));
extern "C" void qwen4exp_simt_trampoline() __asm__(QWEN4EXP_SIMT_SYMBOL("trampoline"));
// clang-format on
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".globl " QWEN4EXP_SIMT_SYMBOL("switch") "\n"
    ".hidden " QWEN4EXP_SIMT_SYMBOL("switch") "\n"
    ".type " QWEN4EXP_SIMT_SYMBOL("switch") ", @function\n"
    QWEN4EXP_SIMT_SYMBOL("switch") ":\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    ".size " QWEN4EXP_SIMT_SYMBOL("switch") ", .-" QWEN4EXP_SIMT_SYMBOL("switch") "\n"
    ".p2align 4\n"
    ".globl " QWEN4EXP_SIMT_SYMBOL("trampoline") "\n"
    ".hidden " QWEN4EXP_SIMT_SYMBOL("trampoline") "\n"
    ".type " QWEN4EXP_SIMT_SYMBOL("trampoline") ", @function\n"
    QWEN4EXP_SIMT_SYMBOL("trampoline") ":\n"
    "  movq %rbx, %rdi\n"
    "  callq *%r12\n"
    "  ud2\n"
    ".size " QWEN4EXP_SIMT_SYMBOL("trampoline") ", .-" QWEN4EXP_SIMT_SYMBOL("trampoline") "\n");

struct FiberContext {
  void* sp = nullptr;
};

void fiber_prepare(FiberContext& context, char* stack, size_t size, void (*entry)(void*),
                   void* arg) {
  // After switch pops these 7 words, the trampoline runs with rsp = top (16-byte aligned), as
  // the ABI wants before its call.
  const uint64_t top = reinterpret_cast<uint64_t>(stack + size) & ~uint64_t{15};
  uint64_t* slot = reinterpret_cast<uint64_t*>(top) - 7;
  slot[0] = 0;                                                      // r15
  slot[1] = 0;                                                      // r14
  slot[2] = 0;                                                      // r13
  slot[3] = reinterpret_cast<uint64_t>(entry);                      // r12
  slot[4] = reinterpret_cast<uint64_t>(arg);                        // rbx
  slot[5] = 0;                                                      // rbp
  slot[6] = reinterpret_cast<uint64_t>(&qwen4exp_simt_trampoline);  // return address
  context.sp = slot;
}

void fiber_switch(FiberContext& from, FiberContext& to) { qwen4exp_simt_switch(&from.sp, to.sp); }

#else  // ucontext

struct FiberContext {
  ucontext_t context;
};

// makecontext passes int arguments only: the pointer travels as two halves. Every fiber has the
// same entry (Scheduler::lane_entry), so it can be a global.
void (*ucontext_target)(void*) = nullptr;

void ucontext_entry(unsigned high, unsigned low) {
  ucontext_target(reinterpret_cast<void*>((static_cast<uintptr_t>(high) << 32) | low));
  std::abort();  // the entry never returns
}

void fiber_prepare(FiberContext& context, char* stack, size_t size, void (*entry)(void*),
                   void* arg) {
  ucontext_target = entry;
  const uintptr_t bits = reinterpret_cast<uintptr_t>(arg);
  getcontext(&context.context);
  context.context.uc_stack.ss_sp = stack;
  context.context.uc_stack.ss_size = size;
  context.context.uc_link = nullptr;
  makecontext(&context.context, reinterpret_cast<void (*)()>(&ucontext_entry), 2,
              static_cast<unsigned>(bits >> 32), static_cast<unsigned>(bits & 0xFFFFFFFFu));
}

void fiber_switch(FiberContext& from, FiberContext& to) { swapcontext(&from.context, &to.context); }

#endif

// ---- AddressSanitizer's view of the stacks ------------------------------------------------------

struct StackBounds {
  const void* bottom = nullptr;
  size_t size = 0;
};

#if defined(QWEN4EXP_SIMT_ASAN)
void asan_start_switch(void** fake_stack, const StackBounds& to) {
  __sanitizer_start_switch_fiber(fake_stack, to.bottom, to.size);
}
void asan_finish_switch(void* fake_stack, StackBounds* from) {
  const void* bottom = nullptr;
  size_t size = 0;
  __sanitizer_finish_switch_fiber(fake_stack, &bottom, &size);
  if (from != nullptr) *from = StackBounds{bottom, size};
}
void asan_poison(const void* p, size_t n) { ASAN_POISON_MEMORY_REGION(p, n); }
void asan_unpoison(const void* p, size_t n) { ASAN_UNPOISON_MEMORY_REGION(p, n); }
#else
void asan_start_switch(void**, const StackBounds&) {}
void asan_finish_switch(void*, StackBounds*) {}
void asan_poison(const void*, size_t) {}
void asan_unpoison(const void*, size_t) {}
#endif

// ---- Lanes and blocks ---------------------------------------------------------------------------

enum class Wait : uint8_t { kRunnable, kBarrier, kShuffle, kDone, kFailed };

struct Lane {
  FiberContext context;
  LaneCoordinates coordinates;
  Wait wait = Wait::kRunnable;
  int index = 0;          // linear thread index in the block
  uint64_t barriers = 0;  // __syncthreads reached
  uint64_t shuffles = 0;  // shuffles reached
  Site site{"", 0};       // the barrier or shuffle it waits at
  char* stack = nullptr;
  void* fake_stack = nullptr;  // ASan's fake stack of this fiber while it is switched out
};

constexpr size_t kStackBytes = size_t{256} << 10;  // virtual; a kernel touches a few pages
constexpr size_t kStackColors = 64 << 10;
constexpr size_t kStackTopBytes = 16 << 10;          // holds lane_entry's frame
constexpr size_t kRedzone = 64;                      // poisoned bytes between shared objects
constexpr size_t kArenaBytes = 2 * kMaxSharedBytes;  // room for the limit plus the redzones
constexpr unsigned char kPoison = 0xFF;              // NaN as fp32/fp64, -1 as integers

struct StaticObject {
  const void* tag;
  size_t offset;
};

// The stacks of up to kMaxThreadsPerBlock lanes, each above a guard page, made once.
class StackPool {
 public:
  char* stack(int lane) {
    if (base_ == nullptr) {
      page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
      const size_t bytes = kMaxThreadsPerBlock * (kStackBytes + page_);
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) {
        std::fprintf(stderr, "simt: cannot map %zu bytes of fiber stacks\n", bytes);
        std::abort();
      }
      base_ = static_cast<char*>(p);
      for (unsigned i = 0; i < kMaxThreadsPerBlock; ++i) {
        mprotect(base_ + i * (kStackBytes + page_), page_, PROT_NONE);  // overflow faults
      }
    }
    return base_ + static_cast<size_t>(lane) * (kStackBytes + page_) + page_;
  }

 private:
  char* base_ = nullptr;
  size_t page_ = 0;
};

// splitmix64: seeds one generator per block from (seed, block), so every block's orders are
// reproducible on their own.
uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

struct Rng {
  uint64_t state;
  uint64_t next() { return state = mix64(state); }
  // In [0, n) for n < 2^32 (Lemire's multiply-shift: no division in the shuffle's hot loop).
  uint32_t below(uint32_t n) { return static_cast<uint32_t>(((next() >> 32) * n) >> 32); }
};

uint64_t seed_from_environment() {
  const char* value = std::getenv("QWEN4EXP_SIMT_SEED");
  if (value == nullptr || *value == '\0') return 0;
  char* end = nullptr;
  const unsigned long long parsed = std::strtoull(value, &end, 0);
  if (end == value || *end != '\0') {
    std::fprintf(stderr, "simt: ignoring QWEN4EXP_SIMT_SEED=%s (not an integer)\n", value);
    return 0;
  }
  return parsed;
}

uint64_t lane_order_seed = seed_from_environment();

class Scheduler {
 public:
  Scheduler() {
    arena_ = static_cast<unsigned char*>(std::aligned_alloc(64, kArenaBytes));
    asan_poison(arena_, kArenaBytes);
  }

  hipError_t run(const KernelBody& body, dim3 grid, dim3 block, size_t shared_bytes);

  // Called from lanes.
  void wait_at_barrier(Site site);
  uint64_t shuffle(uint64_t bits, int mask, int width, Site site);
  void* static_shared(const void* tag, size_t bytes, size_t align);
  void* dynamic_shared(size_t align);

 private:
  static void lane_entry(void* arg);
  void yield(Lane& lane);
  void record_error(std::string message);
  [[noreturn]] void abandon(Lane& lane);
  bool run_block(const uint3& block_idx);
  bool release_waves();
  bool release_block();
  std::string describe_waits() const;
  void start_block_shared();
  void end_block_shared();

  const KernelBody* body_ = nullptr;
  uint3 block_dim_{};
  uint3 grid_dim_{};
  int lanes_in_block_ = 0;
  std::vector<Lane> lanes_;
  std::vector<int> order_;
  // [wave][parity][lane]: a shuffle writes buffer (count & 1); the next shuffle of the wave uses
  // the other one, so one rendezvous per shuffle is enough.
  std::vector<uint64_t> exchange_;
  StackPool stacks_;
  FiberContext scheduler_context_;
  StackBounds scheduler_stack_;
  void* scheduler_fake_stack_ = nullptr;
  Lane* running_ = nullptr;
  Rng rng_{0};
  std::string error_;
  // Shared memory of the running block: [0, dynamic) then the static objects.
  unsigned char* arena_ = nullptr;
  size_t dynamic_bytes_ = 0;
  size_t arena_end_ = 0;     // first byte past the last object (with redzones)
  size_t shared_bytes_ = 0;  // bytes of shared memory handed out (the limit counts these)
  std::vector<StaticObject> statics_;
};

std::mutex launch_mutex;
Scheduler* scheduler = nullptr;  // made on first launch, kept for the process
LaunchRecord launch_record{};    // since the last take_launch_record

bool same_site(const Site& a, const Site& b) {
  return a.line == b.line && (a.file == b.file || std::strcmp(a.file, b.file) == 0);
}

std::string dims(const dim3& d) {
  return "(" + std::to_string(d.x) + ", " + std::to_string(d.y) + ", " + std::to_string(d.z) + ")";
}

// What a GPU would refuse: the intersection of CUDA's and ROCm's limits, so a launch that passes
// here passes on both (ROCm counts the grid in threads, in 32 bits per dimension).
std::string launch_limits(const dim3& grid, const dim3& block, size_t shared_bytes) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (block.x == 0 || block.y == 0 || block.z == 0)
    return "a block of " + dims(block) + " threads is empty";
  if (threads > kMaxThreadsPerBlock || block.z > 64) {
    return "a block of " + dims(block) + " threads is more than the " +
           std::to_string(kMaxThreadsPerBlock) + " a GPU runs (and z <= 64)";
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0)
    return "a grid of " + dims(grid) + " blocks is empty";
  if (grid.x > 0x7FFFFFFFu || grid.y > 65535 || grid.z > 65535) {
    return "a grid of " + dims(grid) + " blocks is past the limits (x < 2^31, y and z <= 65535)";
  }
  const uint64_t per_dim[3] = {uint64_t{grid.x} * block.x, uint64_t{grid.y} * block.y,
                               uint64_t{grid.z} * block.z};
  for (uint64_t n : per_dim) {
    if (n > 0xFFFFFFFFull) {
      return "grid " + dims(grid) + " x block " + dims(block) +
             " has 2^32 or more threads along one dimension (ROCm counts them in 32 bits)";
    }
  }
  if (shared_bytes > kMaxSharedBytes) {
    return std::to_string(shared_bytes) + " bytes of dynamic shared memory is more than the " +
           std::to_string(kMaxSharedBytes) + " a block may have";
  }
  return {};
}

hipError_t Scheduler::run(const KernelBody& body, dim3 grid, dim3 block, size_t shared_bytes) {
  const std::string refused = launch_limits(grid, block, shared_bytes);
  if (!refused.empty()) return fail(hipErrorInvalidConfiguration, "launch refused: " + refused);
  body_ = &body;
  block_dim_ = uint3{block.x, block.y, block.z};
  grid_dim_ = uint3{grid.x, grid.y, grid.z};
  lanes_in_block_ = static_cast<int>(block.x * block.y * block.z);
  lanes_.assign(lanes_in_block_, Lane{});
  order_.resize(lanes_in_block_);
  const int waves = (lanes_in_block_ + kWaveSize - 1) / kWaveSize;
  exchange_.assign(static_cast<size_t>(waves) * 2 * kWaveSize, 0);
  dynamic_bytes_ = shared_bytes;

  // Blocks in a seeded order too (a stride coprime to the count visits each once): a kernel
  // whose blocks depend on running in index order fails.
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  Rng order_rng{mix64(lane_order_seed ^ 0x5157u ^ blocks)};
  uint64_t stride = 1 + order_rng.next() % blocks;
  while (std::gcd(stride, blocks) != 1) stride = stride % blocks + 1;
  uint64_t linear = order_rng.next() % blocks;
  for (uint64_t i = 0; i < blocks; ++i, linear = (linear + stride) % blocks) {
    const uint3 block_idx{static_cast<unsigned>(linear % grid.x),
                          static_cast<unsigned>((linear / grid.x) % grid.y),
                          static_cast<unsigned>(linear / (uint64_t{grid.x} * grid.y))};
    rng_ = Rng{mix64(lane_order_seed) ^ linear};
    if (!run_block(block_idx)) {
      // The lanes left suspended are abandoned: their stacks are reused from the top.
      for (int i = 0; i < lanes_in_block_; ++i) asan_unpoison(stacks_.stack(i), kStackBytes);
      end_block_shared();
      return fail(hipErrorLaunchFailure, "block " +
                                             dims(dim3(block_idx.x, block_idx.y, block_idx.z)) +
                                             " of grid " + dims(grid) + ": " + error_);
    }
    end_block_shared();
  }
  last_message.clear();  // hipGetErrorString must not describe an older failure
  return hipSuccess;
}

void Scheduler::start_block_shared() {
  statics_.clear();
  asan_unpoison(arena_, dynamic_bytes_);
  std::memset(arena_, kPoison, dynamic_bytes_);
  arena_end_ = dynamic_bytes_ + kRedzone;
  shared_bytes_ = dynamic_bytes_;
}

void Scheduler::end_block_shared() { asan_poison(arena_, kArenaBytes); }

bool Scheduler::run_block(const uint3& block_idx) {
  start_block_shared();
  error_.clear();
  for (int i = 0; i < lanes_in_block_; ++i) {
    Lane& lane = lanes_[i];
    lane = Lane{};
    lane.index = i;
    const unsigned xy = block_dim_.x * block_dim_.y;
    const unsigned u = static_cast<unsigned>(i);
    lane.coordinates =
        LaneCoordinates{uint3{u % block_dim_.x, (u / block_dim_.x) % block_dim_.y, u / xy},
                        block_idx, block_dim_, grid_dim_};
    lane.stack = stacks_.stack(i);
    // Stack tops 64 bytes apart modulo 64 KiB: otherwise every lane's frames fall in the same
    // few cache sets (the stacks are a multiple of 4 KiB apart) and each switch misses.
    const size_t usable = kStackBytes - (static_cast<size_t>(i) * 64) % kStackColors;
    // The last fiber on this stack ended inside lane_entry, whose frame (with ASan's redzones)
    // lies where the new fiber's first frames go.
    asan_unpoison(lane.stack + usable - kStackTopBytes, kStackTopBytes);
    fiber_prepare(lane.context, lane.stack, usable, &Scheduler::lane_entry, &lane);
    order_[i] = i;
  }
  int done = 0;
  while (true) {
    for (int i = lanes_in_block_ - 1; i > 0; --i) {
      std::swap(order_[i], order_[rng_.below(static_cast<uint32_t>(i) + 1)]);
    }
    for (int i : order_) {
      Lane& lane = lanes_[i];
      if (lane.wait != Wait::kRunnable) continue;
      running_ = &lane;
      current_lane_coordinates = &lane.coordinates;
      asan_start_switch(&scheduler_fake_stack_, StackBounds{lane.stack, kStackBytes});
      fiber_switch(scheduler_context_, lane.context);
      asan_finish_switch(scheduler_fake_stack_, nullptr);
      running_ = nullptr;
      current_lane_coordinates = nullptr;
      if (lane.wait == Wait::kDone) ++done;
      if (!error_.empty()) return false;
    }
    if (done == lanes_in_block_) return true;
    if (!release_waves() && !release_block()) {
      if (error_.empty()) error_ = "deadlock: " + describe_waits();
      return false;
    }
    if (!error_.empty()) return false;
  }
}

// A wave whose lanes all wait at the same shuffle goes on; a shuffle that some lanes of the wave
// cannot join (they have returned, or the block's last wave is partial) is an error, since a
// GPU would read an inactive lane's register.
bool Scheduler::release_waves() {
  bool released = false;
  for (int first = 0; first < lanes_in_block_; first += kWaveSize) {
    const int last = std::min(first + kWaveSize, lanes_in_block_);
    int shuffling = 0, waiting_elsewhere = 0;
    for (int i = first; i < last; ++i) {
      if (lanes_[i].wait == Wait::kShuffle) ++shuffling;
      else if (lanes_[i].wait != Wait::kBarrier) ++waiting_elsewhere;  // done
    }
    if (shuffling == 0) continue;
    const Lane& lead = lanes_[first];
    if (last - first < kWaveSize || waiting_elsewhere > 0) {
      error_ = "a shuffle in wave " + std::to_string(first / kWaveSize) + " while some of its " +
               std::to_string(kWaveSize) +
               " lanes have returned or do not exist (their registers are undefined)";
      return false;
    }
    if (shuffling < last - first) continue;  // others wait at a barrier: deadlock unless freed
    for (int i = first; i < last; ++i) {
      if (lanes_[i].shuffles != lead.shuffles || !same_site(lanes_[i].site, lead.site)) {
        error_ = "lanes of wave " + std::to_string(first / kWaveSize) +
                 " wait at different shuffles (divergent code): " + describe_waits();
        return false;
      }
    }
    for (int i = first; i < last; ++i) lanes_[i].wait = Wait::kRunnable;
    released = true;
  }
  return released;
}

// The block goes on when every lane that has not returned waits at the same __syncthreads
// (returned lanes no longer take part, as on the GPU).
bool Scheduler::release_block() {
  const Lane* lead = nullptr;
  for (const Lane& lane : lanes_) {
    if (lane.wait == Wait::kDone) continue;
    if (lane.wait != Wait::kBarrier) return false;
    if (lead == nullptr) lead = &lane;
    if (lane.barriers != lead->barriers || !same_site(lane.site, lead->site)) {
      error_ = "lanes wait at different __syncthreads (a barrier in divergent code): " +
               describe_waits();
      return false;
    }
  }
  if (lead == nullptr) return false;
  for (Lane& lane : lanes_) {
    if (lane.wait == Wait::kBarrier) lane.wait = Wait::kRunnable;
  }
  return true;
}

std::string Scheduler::describe_waits() const {
  std::string text;
  int shown = 0;
  for (const Lane& lane : lanes_) {
    if (lane.wait == Wait::kDone) continue;
    if (shown == 8) {
      text += ", ...";
      break;
    }
    if (shown++ > 0) text += ", ";
    text += "thread " + std::to_string(lane.index) +
            (lane.wait == Wait::kBarrier ? " at __syncthreads #" + std::to_string(lane.barriers)
                                         : " at shuffle #" + std::to_string(lane.shuffles)) +
            " (" + lane.site.file + ":" + std::to_string(lane.site.line) + ")";
  }
  return text;
}

void Scheduler::lane_entry(void* arg) {
  Lane& lane = *static_cast<Lane*>(arg);
  Scheduler& s = *scheduler;
  asan_finish_switch(nullptr, &s.scheduler_stack_);
  s.body_->run(s.body_->context);
  lane.wait = Wait::kDone;
  asan_start_switch(nullptr, s.scheduler_stack_);  // this fiber ends: drop its fake stack
  fiber_switch(lane.context, s.scheduler_context_);
  std::abort();  // a finished lane is never resumed
}

void Scheduler::yield(Lane& lane) {
  asan_start_switch(&lane.fake_stack, scheduler_stack_);
  fiber_switch(lane.context, scheduler_context_);
  asan_finish_switch(lane.fake_stack, nullptr);
}

// An error found inside a lane: recorded for the launch (a statement of its own, so that the
// message's temporaries are gone before the lane is abandoned), and the lane never runs again.
void Scheduler::record_error(std::string message) {
  if (error_.empty()) error_ = std::move(message);
}

void Scheduler::abandon(Lane& lane) {
  lane.wait = Wait::kFailed;
  yield(lane);
  std::abort();  // never resumed
}

void Scheduler::wait_at_barrier(Site site) {
  Lane& lane = *running_;
  ++lane.barriers;
  lane.site = site;
  lane.wait = Wait::kBarrier;
  yield(lane);
}

uint64_t Scheduler::shuffle(uint64_t bits, int mask, int width, Site site) {
  Lane& lane = *running_;
  if (width <= 0 || width > kWaveSize || (width & (width - 1)) != 0) {
    record_error("shuffle width " + std::to_string(width) +
                 " is not a power of two of at most the wave size " + std::to_string(kWaveSize));
    abandon(lane);
  }
  const int wave = lane.index / kWaveSize;
  const int self = lane.index % kWaveSize;
  uint64_t* buffer =
      exchange_.data() + (static_cast<size_t>(wave) * 2 + (lane.shuffles & 1)) * kWaveSize;
  buffer[self] = bits;
  ++lane.shuffles;
  lane.site = site;
  lane.wait = Wait::kShuffle;
  yield(lane);
  // HIP's and CUDA's rule: a source outside the lane's segment of `width` lanes reads its own.
  const int source = self ^ mask;
  const int segment_end = (self + width) & ~(width - 1);
  return buffer[(source >= 0 && source < segment_end) ? source : self];
}

void* Scheduler::static_shared(const void* tag, size_t bytes, size_t align) {
  for (const StaticObject& object : statics_) {
    if (object.tag == tag) return arena_ + object.offset;
  }
  const size_t alignment = std::max<size_t>(align, 16);
  const size_t offset = (arena_end_ + alignment - 1) / alignment * alignment;
  if (shared_bytes_ + bytes > kMaxSharedBytes || offset + bytes + kRedzone > kArenaBytes) {
    record_error("the block's shared memory (" + std::to_string(dynamic_bytes_) +
                 " dynamic bytes and the __shared__ objects) is more than the " +
                 std::to_string(kMaxSharedBytes) + " a block may have");
    abandon(*running_);
  }
  asan_unpoison(arena_ + offset, bytes);
  std::memset(arena_ + offset, kPoison, bytes);
  statics_.push_back(StaticObject{tag, offset});
  arena_end_ = offset + bytes + kRedzone;
  shared_bytes_ += bytes;
  return arena_ + offset;
}

void* Scheduler::dynamic_shared(size_t align) {
  if (align > 64) {
    record_error("dynamic shared memory is aligned to 64 bytes at most");
    abandon(*running_);
  }
  return arena_;
}

}  // namespace

void sync_block(Site site) { scheduler->wait_at_barrier(site); }

uint64_t shuffle_xor_bits(uint64_t bits, int mask, int width, Site site) {
  return scheduler->shuffle(bits, mask, width, site);
}

void* static_shared(const void* tag, size_t bytes, size_t align) {
  return scheduler->static_shared(tag, bytes, align);
}

void* dynamic_shared(size_t align) { return scheduler->dynamic_shared(align); }

hipError_t launch(const KernelBody& body, dim3 grid, dim3 block, size_t shared_bytes) {
  std::lock_guard<std::mutex> lock(launch_mutex);
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  ++launch_record.launches;
  launch_record.most_blocks = std::max(launch_record.most_blocks, blocks);
  if (scheduler == nullptr) scheduler = new Scheduler();  // lives as long as the process
  return scheduler->run(body, grid, block, shared_bytes);
}

LaunchRecord take_launch_record() {
  std::lock_guard<std::mutex> lock(launch_mutex);
  const LaunchRecord taken = launch_record;
  launch_record = LaunchRecord{};
  return taken;
}

void set_seed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(launch_mutex);
  lane_order_seed = seed;
}

uint64_t seed() {
  std::lock_guard<std::mutex> lock(launch_mutex);
  return lane_order_seed;
}

}  // namespace simt
}  // namespace qwen4exp
