#include "paratrain/parallel/module_hooks.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <utility>
#include <vector>

// libtorch's Module has no slot for hooks, so they live in a table keyed by the module's address,
// with a weak pointer to tell a live module from a later one at the same address.

namespace paratrain {
namespace {

// One module's hooks, never changed once made: a registration makes a new set, so a forward
// takes the current one (a pointer copy under the lock) and runs it without holding the lock.
struct HookLists {
  std::vector<ForwardHook> pre;
  std::vector<ForwardHook> post;
  std::vector<ForwardWrapper> wrappers;
};

struct Hooks {
  std::weak_ptr<const torch::nn::Module> owner;
  std::shared_ptr<const HookLists> lists;
};

struct Table {
  std::shared_mutex mutex;
  std::unordered_map<const torch::nn::Module*, Hooks> hooks;
  std::atomic<size_t> count{0};  // lets modules without hooks skip the lock
};

Table& table() {
  static Table t;
  return t;
}

std::weak_ptr<const torch::nn::Module> owner_of(const torch::nn::Module& module) {
  try {
    return module.shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    TORCH_CHECK(false, "register_forward_hook: the module ", module.name(),
                " is not held by a shared_ptr; hold it in its ModuleHolder (or as a child)");
  }
}

// Moves the hooks of modules that are gone into `gone`, under the table's unique lock; the caller
// destroys them after unlocking (what they hold, process groups, may take time to close).
void purge(Table& t, std::vector<Hooks>& gone) {
  for (auto it = t.hooks.begin(); it != t.hooks.end();) {
    if (it->second.owner.expired()) {
      gone.push_back(std::move(it->second));
      it = t.hooks.erase(it);
    } else {
      ++it;
    }
  }
  t.count = t.hooks.size();
}

// Adds to `module`'s hooks what `add` puts in a copy of them.
void add_hooks(const torch::nn::Module& module, const std::function<void(HookLists&)>& add) {
  Table& t = table();
  std::vector<Hooks> gone;               // destroyed after the lock is released
  std::shared_ptr<const HookLists> old;  // likewise
  std::unique_lock<std::shared_mutex> lock(t.mutex);
  purge(t, gone);  // also a module at this address that is gone: its hooks went with it
  auto it = t.hooks.find(&module);
  if (it == t.hooks.end()) {
    it = t.hooks.emplace(&module, Hooks{owner_of(module), std::make_shared<HookLists>()}).first;
    t.count = t.hooks.size();
  }
  auto lists = std::make_shared<HookLists>(*it->second.lists);
  add(*lists);
  old = std::exchange(it->second.lists, std::move(lists));
}

}  // namespace

void register_forward_pre_hook(const torch::nn::Module& module, ForwardHook hook) {
  TORCH_CHECK(hook != nullptr, "register_forward_pre_hook: the hook is empty");
  add_hooks(module, [&](HookLists& l) { l.pre.push_back(std::move(hook)); });
}

void register_forward_hook(const torch::nn::Module& module, ForwardHook hook) {
  TORCH_CHECK(hook != nullptr, "register_forward_hook: the hook is empty");
  add_hooks(module, [&](HookLists& l) { l.post.push_back(std::move(hook)); });
}

void register_forward_wrapper(const torch::nn::Module& module, ForwardWrapper wrapper) {
  TORCH_CHECK(wrapper != nullptr, "register_forward_wrapper: the wrapper is empty");
  add_hooks(module, [&](HookLists& l) { l.wrappers.push_back(std::move(wrapper)); });
}

void remove_forward_hooks(const torch::nn::Module& module) {
  Table& t = table();
  std::vector<Hooks> gone;  // destroyed after the lock is released
  std::unique_lock<std::shared_mutex> lock(t.mutex);
  auto it = t.hooks.find(&module);
  if (it != t.hooks.end()) {
    gone.push_back(std::move(it->second));
    t.hooks.erase(it);
  }
  purge(t, gone);
}

bool has_forward_hooks(const torch::nn::Module& module) {
  Table& t = table();
  std::shared_lock<std::shared_mutex> lock(t.mutex);
  auto it = t.hooks.find(&module);
  return it != t.hooks.end() && !it->second.owner.expired();
}

torch::Tensor call_with_hooks(const torch::nn::Module& module,
                              const torch::Tensor& input,
                              const ForwardFunction& forward) {
  Table& t = table();
  if (t.count.load() == 0) {
    return forward(input);
  }
  std::shared_ptr<const HookLists> hooks;
  {
    std::shared_lock<std::shared_mutex> lock(t.mutex);
    auto it = t.hooks.find(&module);
    if (it != t.hooks.end() && !it->second.owner.expired()) {
      hooks = it->second.lists;
    }
  }
  if (hooks == nullptr) {
    return forward(input);
  }
  torch::Tensor x = input;
  for (const auto& hook : hooks->pre) {
    x = hook(x);
  }
  // The first wrapper registered is the outermost: each one's `forward` is the next one's.
  ForwardFunction run = forward;
  for (size_t i = hooks->wrappers.size(); i-- > 0;) {
    // The set is held, not referred to: a wrapper may keep `forward` for later (checkpoint() runs
    // it again in backward), after a registration has replaced the set.
    run = [hooks, i, inner = std::move(run)](const torch::Tensor& in) {
      return hooks->wrappers[i](in, inner);
    };
  }
  torch::Tensor y = run(x);
  for (const auto& hook : hooks->post) {
    y = hook(y);
  }
  return y;
}

}  // namespace paratrain
