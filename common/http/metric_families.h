// Building prometheus-cpp MetricFamily values by hand, for collectors that read their
// figures at scrape time (the coordinator's scheduler snapshot, the agent's ranks).
#ifndef LATHE_COMMON_HTTP_METRIC_FAMILIES_H_
#define LATHE_COMMON_HTTP_METRIC_FAMILIES_H_

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "prometheus/client_metric.h"
#include "prometheus/metric_family.h"
#include "prometheus/metric_type.h"

namespace lathe {

inline prometheus::MetricFamily MakeFamily(std::string name, std::string help,
                                           prometheus::MetricType type) {
  prometheus::MetricFamily family;
  family.name = std::move(name);
  family.help = std::move(help);
  family.type = type;
  return family;
}

// One sample of a counter or gauge family.
inline void AddSample(prometheus::MetricFamily& family,
                      std::vector<prometheus::ClientMetric::Label> labels, double value) {
  prometheus::ClientMetric& metric = family.metric.emplace_back();
  metric.label = std::move(labels);
  if (family.type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
}

// One histogram: `counts[i]` observations at or below `bounds[i]` (cumulative), `count` in
// all (the +Inf bucket), `sum` their sum.
inline void AddHistogram(prometheus::MetricFamily& family,
                         std::vector<prometheus::ClientMetric::Label> labels,
                         const std::vector<double>& bounds, const std::vector<uint64_t>& counts,
                         uint64_t count, double sum) {
  prometheus::ClientMetric& metric = family.metric.emplace_back();
  metric.label = std::move(labels);
  metric.histogram.sample_count = count;
  metric.histogram.sample_sum = sum;
  for (size_t i = 0; i < bounds.size(); ++i) {
    metric.histogram.bucket.push_back({counts[i], bounds[i]});
  }
  metric.histogram.bucket.push_back({count, std::numeric_limits<double>::infinity()});
}

}  // namespace lathe

#endif  // LATHE_COMMON_HTTP_METRIC_FAMILIES_H_
