#include "idem/maintenance.hpp"

#include <stdexcept>
#include <thread>
#include <utility>

#include "drive.hpp"
#include "maintenance_jobs.hpp"

namespace idem {

struct MaintenanceThread::Impl
    : detail::MaintenanceJobs<detail::BlockingEffects, Completer::Resume> {
  using MaintenanceJobs::MaintenanceJobs;
  std::thread thread;
};

MaintenanceThread::MaintenanceThread(Coordinator& coordinator, MaintenanceOptions options)
    : impl_(std::make_shared<Impl>(coordinator, std::move(options))) {}

MaintenanceThread::~MaintenanceThread() { stop(); }

void MaintenanceThread::resume(std::string operation, Completer::Resume resume) {
  impl_->resume(std::move(operation), std::move(resume));
}

void MaintenanceThread::deliver(Delivery delivery) { impl_->deliver(std::move(delivery)); }

MaintenanceReport MaintenanceThread::run_once() {
  return impl_->run_once(detail::BlockingEffects{{}, impl_->core()}).get();
}

void MaintenanceThread::start() {
  if (impl_->thread.joinable()) throw std::logic_error("idem: MaintenanceThread started twice");
  impl_->thread = std::thread([d = impl_] {
    Impl::loop(d, detail::BlockingEffects{{}, d->core()}).get();
  });
}

void MaintenanceThread::stop() noexcept {
  impl_->stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

MaintenanceReport MaintenanceThread::totals() const { return impl_->totals_now(); }

}  // namespace idem
