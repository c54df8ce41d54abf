// lockstep-netlab-delay QUEUE DELAY_US: holds every packet that netfilter
// queues to QUEUE for DELAY_US microseconds, then lets it go, in the order
// they came. scripts/netlab.sh runs one in each lab host, behind an
// iptables rule that queues the host's outgoing packets, to add a link's
// latency where the kernel has no netem.
//
// Note [Latency without netem]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// netem is the usual way to delay packets, and this machine's kernel is
// built without it (and without fq, whose departure times a BPF program
// could set). It has NFQUEUE, which hands each packet's metadata to a
// process and waits for its verdict. With one delay for every packet,
// holding them in a FIFO and accepting each when its time comes keeps
// their order, as netem's delay does; a batch verdict accepts every packet
// up to the last one due. Only metadata is copied (no payload), and GSO
// packets come whole (NFQA_CFG_F_GSO), so the cost is a few system calls
// per 64 KiB segment. A timer slack of 1 us keeps the kernel from rounding
// the waits up by its default 50 us. The delay is measured from when this
// process reads the packet, so it is a lower bound that a busy machine
// stretches; tests/netlab_latency.sh checks that it holds.
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <arpa/inet.h>
#include <linux/netfilter.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>

namespace {

using Clock = std::chrono::steady_clock;

struct Held {
  uint32_t id;
  Clock::time_point due;
};

struct Delay {
  std::deque<Held> held;
  std::chrono::microseconds delay;
};

int on_packet(nfq_q_handle* /*queue*/, nfgenmsg* /*message*/, nfq_data* packet, void* data) {
  auto& state = *static_cast<Delay*>(data);
  const auto* header = nfq_get_msg_packet_hdr(packet);
  if (header != nullptr) {
    state.held.push_back({ntohl(header->packet_id), Clock::now() + state.delay});
  }
  return 0;
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "lockstep-netlab-delay: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(1);
}

// Accepts every held packet whose time has come, with one verdict.
void release_due(nfq_q_handle* queue, Delay& state) {
  const auto now = Clock::now();
  uint32_t last = 0;
  bool any = false;
  while (!state.held.empty() && state.held.front().due <= now) {
    last = state.held.front().id;
    any = true;
    state.held.pop_front();
  }
  if (any && nfq_set_verdict_batch(queue, last, NF_ACCEPT) < 0) {
    die("the verdict for packet " + std::to_string(last));
  }
}

nfq_q_handle* open_queue(nfq_handle* handle, int number, Delay& state) {
  nfq_q_handle* queue = nfq_create_queue(handle, static_cast<uint16_t>(number), &on_packet, &state);
  if (queue == nullptr) {
    die("cannot bind netfilter queue " + std::to_string(number) + " (is another process bound to it?)");
  }
  if (nfq_set_mode(queue, NFQNL_COPY_META, 0) < 0) {
    die("cannot ask for packets' metadata only");
  }
  const uint32_t flags = NFQA_CFG_F_GSO;
  if (nfq_set_queue_flags(queue, flags, flags) < 0) {
    die("cannot take GSO packets whole");
  }
  nfq_set_queue_maxlen(queue, 1 << 16);
  nfnl_rcvbufsiz(nfq_nfnlh(handle), 16 << 20); // room for every held packet's message
  return queue;
}

// Waits until the first held packet is due or a packet comes, then reads
// every packet that came (on_packet holds each).
void wait_and_read(nfq_handle* handle, const Delay& state) {
  static char buffer[1 << 16];
  timespec wait{};
  timespec* timeout = nullptr;
  if (!state.held.empty()) {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(state.held.front().due - Clock::now()).count();
    wait.tv_sec = ns > 0 ? ns / 1000000000 : 0;
    wait.tv_nsec = ns > 0 ? ns % 1000000000 : 0;
    timeout = &wait;
  }
  pollfd fd{nfq_fd(handle), POLLIN, 0};
  if (ppoll(&fd, 1, timeout, nullptr) < 0 && errno != EINTR) {
    die("poll");
  }
  for (;;) {
    const ssize_t got = recv(fd.fd, buffer, sizeof(buffer), MSG_DONTWAIT);
    if (got < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
        return;
      }
      die(errno == ENOBUFS ? "packets were lost to a full netlink buffer" : "receiving from the queue");
    }
    nfq_handle_packet(handle, buffer, static_cast<int>(got));
  }
}

} // namespace

int main(int argc, char** argv) {
  char* end = nullptr;
  const long number = argc == 3 ? std::strtol(argv[1], &end, 10) : -1;
  const long delay_us = argc == 3 && *end == '\0' ? std::strtol(argv[2], &end, 10) : -1;
  if (number < 0 || number > 65535 || delay_us < 0 || *end != '\0') {
    std::fprintf(stderr, "usage: lockstep-netlab-delay QUEUE DELAY_US (QUEUE 0-65535, DELAY_US a whole number)\n");
    return 2;
  }
  prctl(PR_SET_TIMERSLACK, 1UL);
  Delay state{{}, std::chrono::microseconds(delay_us)};
  nfq_handle* handle = nfq_open();
  if (handle == nullptr) {
    die("cannot open a netfilter queue handle (needs CAP_NET_ADMIN)");
  }
  nfq_q_handle* queue = open_queue(handle, static_cast<int>(number), state);
  std::printf("lockstep-netlab-delay: queue %ld, %ld us\n", number, delay_us);
  std::fflush(stdout); // scripts/netlab.sh waits for this line before it queues packets here
  for (;;) {
    release_due(queue, state);
    wait_and_read(handle, state);
  }
}
