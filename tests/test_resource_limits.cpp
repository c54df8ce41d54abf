// What lockstep does when the system refuses it a resource. These tests set
// process-wide limits, so they live among the process tests, whose binary
// the sanitizer stages of CI do not build: a sanitizer's shadow memory and
// an address-space limit do not mix.

#include <lockstep/lockstep.h>

#include "support/dp_models.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <string>

namespace lockstep {
namespace {

constexpr size_t kGiB = size_t{1} << 30;

// The address space this process has mapped, in bytes.
size_t mapped_bytes() {
  std::ifstream statm("/proc/self/statm");
  size_t pages = 0;
  statm >> pages;
  return pages * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}

// The default stack of new threads, and the address-space limit, while it lives.
class Limits {
 public:
  Limits(size_t stack, size_t more_address_space) {
    pthread_attr_t attr;
    EXPECT_EQ(pthread_getattr_default_np(&attr), 0);
    EXPECT_EQ(pthread_attr_getstacksize(&attr, &old_stack_), 0);
    EXPECT_EQ(pthread_attr_setstacksize(&attr, stack), 0);
    EXPECT_EQ(pthread_setattr_default_np(&attr), 0);
    pthread_attr_destroy(&attr);
    EXPECT_EQ(getrlimit(RLIMIT_AS, &old_limit_), 0);
    rlimit low = old_limit_;
    low.rlim_cur = mapped_bytes() + more_address_space;
    EXPECT_EQ(setrlimit(RLIMIT_AS, &low), 0);
  }
  ~Limits() {
    setrlimit(RLIMIT_AS, &old_limit_);
    pthread_attr_t attr;
    pthread_getattr_default_np(&attr);
    pthread_attr_setstacksize(&attr, old_stack_);
    pthread_setattr_default_np(&attr);
    pthread_attr_destroy(&attr);
  }

 private:
  size_t old_stack_ = 0;
  rlimit old_limit_{};
};

// A replica's thread that the system refuses is an error that says so, not
// std::terminate: the threads already started are ended first.
TEST(DataParallelLimits, AThreadTheSystemRefusesIsAClearErrorNotACrash) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "an address-space limit starves the sanitizer's own mappings";
#endif
  torch::nn::Linear net(4, 2);
  // LibTorch 1.13's at::set_num_threads, which each replica's thread calls,
  // re-creates NNPACK's thread pool with that many threads, and under the
  // limit below a pool whose thread cannot start waits for it forever,
  // inside LibTorch. With one intra-op thread the pool starts none.
  const int caller_threads = at::get_num_threads();
  at::set_num_threads(1);
  std::string error;
  {
    // Stacks of 1 GiB in 2.5 GiB of address space: the first two replicas'
    // threads start, the third cannot.
    Limits limits(kGiB, 5 * kGiB / 2);
    try {
      DataParallel<torch::nn::Linear> dp(net, DataParallelOptions().devices(testing::dp_models::cpus(4)));
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
  }
  at::set_num_threads(caller_threads);
  EXPECT_NE(error.find("lockstep::DataParallel: the system refused thread 3 of the 4 that run the replicas"),
            std::string::npos) << error;
  EXPECT_NE(error.find("raise it, or give DataParallel fewer devices"), std::string::npos) << error;
  DataParallel<torch::nn::Linear> dp(net, DataParallelOptions().devices(testing::dp_models::cpus(4)));
  const auto x = torch::randn({8, 4});
  EXPECT_TRUE(torch::allclose(dp->forward(x), net->forward(x)));
}

} // namespace
} // namespace lockstep
