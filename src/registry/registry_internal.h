// What the plugin loader needs from the registry: attributing the registrations made while a
// plugin's static objects run, and taking them back when the plugin is refused.
#pragma once

#include <string>
#include <vector>

namespace tandem::registry_internal {

// The names in `v` separated by `sep`, for messages.
std::string join(const std::vector<std::string>& v, const char* sep = ", ");

// Registrations between begin_plugin and end_plugin have origin "plugin PATH".
void begin_plugin(const std::string& path);
void end_plugin();
std::string plugin_origin(const std::string& path);

// The registration errors recorded since the last call (and forgets them).
std::vector<std::string> take_errors();

// Names registered with this origin, models and datasets.
std::vector<std::string> models_from(const std::string& origin);
std::vector<std::string> datasets_from(const std::string& origin);
// Removes every model and dataset registered with this origin.
void unregister(const std::string& origin);

}  // namespace tandem::registry_internal
