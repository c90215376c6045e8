//! The label names PromQL queries rely on, against the label names a Prometheus text page
//! exports. A matcher or a grouping that names a label the metric does not carry is no error
//! to Prometheus: it silently matches nothing, or groups everything into one series. The
//! dashboard's and the alerting rules' queries are checked with this against a running mesh
//! (`tests/metrics_audit.rs`).
use std::collections::{BTreeMap, BTreeSet};

/// Labels every scraped series gets from its target, whatever the service exports.
const TARGET_LABELS: [&str; 2] = ["job", "instance"];

/// One label a query relies on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LabelUse {
    /// `metric{label op "value"}`.
    Matcher { metric: String, label: String },
    /// `by (label)`: one of the query's `diffmesh_*` metrics must carry it.
    Grouping {
        label: String,
        metrics: BTreeSet<String>,
    },
}

/// Every label `expr` matches on or groups by.
pub fn label_uses(expr: &str) -> Vec<LabelUse> {
    let metrics = metric_names(expr);
    let mut uses = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if !expr.is_char_boundary(i) {
            i += 1;
            continue;
        }
        if expr[i..].starts_with("diffmesh_") && (i == 0 || !is_name_char(bytes[i - 1])) {
            let end = name_end(expr, i);
            let metric = expr[i..end].to_string();
            if bytes.get(end) == Some(&b'{') {
                let close = closing_brace(expr, end);
                for label in matcher_labels(&expr[end + 1..close]) {
                    uses.push(LabelUse::Matcher {
                        metric: metric.clone(),
                        label,
                    });
                }
                i = close + 1;
            } else {
                i = end;
            }
            continue;
        }
        if let Some(labels) = grouping_at(expr, i) {
            for label in labels {
                uses.push(LabelUse::Grouping {
                    label,
                    metrics: metrics.clone(),
                });
            }
        }
        i += 1;
    }
    uses
}

/// Label names of every family on a Prometheus text page (histogram series under the family's
/// name, `le` included). Families without a sample are absent: their labels are unknown.
pub fn exported_labels(page: &str) -> BTreeMap<String, BTreeSet<String>> {
    let histograms: BTreeSet<&str> = page
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|rest| {
            let mut parts = rest.split_whitespace();
            let name = parts.next()?;
            (parts.next()? == "histogram").then_some(name)
        })
        .collect();
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in page
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let end = name_end(line, 0);
        let family = family_of(&line[..end], |base| histograms.contains(base));
        let labels = out.entry(family).or_default();
        if line.as_bytes().get(end) == Some(&b'{') {
            let close = closing_brace(line, end);
            labels.extend(matcher_labels(&line[end + 1..close]));
        }
    }
    out
}

/// Each use whose label the metrics do not carry, described; uses of metrics with unknown
/// labels are passed over.
pub fn unknown_labels(expr: &str, exported: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let labels_of = |metric: &str| {
        let family = family_of(metric, |base| exported.contains_key(base));
        exported.get(&family)
    };
    let target = |label: &str| TARGET_LABELS.contains(&label);
    let mut problems = Vec::new();
    for u in label_uses(expr) {
        match u {
            LabelUse::Matcher { metric, label } => {
                if let Some(have) = labels_of(&metric) {
                    if !have.contains(&label) && !target(&label) {
                        problems.push(format!(
                            "{metric}{{{label}=...}}: {metric} has labels {have:?}"
                        ));
                    }
                }
            }
            LabelUse::Grouping { label, metrics } => {
                let known: Vec<&BTreeSet<String>> =
                    metrics.iter().filter_map(|m| labels_of(m)).collect();
                if !known.is_empty() && !target(&label) && !known.iter().any(|h| h.contains(&label))
                {
                    problems.push(format!("by ({label}): none of {metrics:?} has it"));
                }
            }
        }
    }
    problems
}

/// The queries of the `expr:` keys of a Prometheus rules file (inline or YAML block scalars;
/// the file's own layout, no YAML parser needed).
pub fn rule_exprs(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut exprs = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let Some(rest) = trimmed
            .strip_prefix("expr:")
            .or_else(|| trimmed.strip_prefix("- expr:"))
        else {
            continue;
        };
        let rest = rest.trim();
        if !matches!(rest, ">-" | ">" | "|" | "|-") {
            exprs.push(rest.trim_matches(['"', '\'']).to_string());
            continue;
        }
        let indent = line.len() - trimmed.len();
        let block: Vec<&str> = lines[i + 1..]
            .iter()
            .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
            .map(|l| l.trim())
            .collect();
        exprs.push(block.join(" "));
    }
    exprs
}

fn is_name_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b':'
}

fn name_end(s: &str, start: usize) -> usize {
    s[start..]
        .bytes()
        .position(|b| !is_name_char(b))
        .map_or(s.len(), |p| start + p)
}

/// A histogram's `_bucket`/`_sum`/`_count` series belong to the family without the suffix.
fn family_of(name: &str, is_family: impl Fn(&str) -> bool) -> String {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix).filter(|base| is_family(base)))
        .unwrap_or(name)
        .to_string()
}

/// Every `diffmesh_*` metric name in `text` (`diffmesh_.+_failures_total` is a regex over
/// names, not a name, and is skipped).
pub fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut i = 0;
    while let Some(p) = text[i..].find("diffmesh_") {
        let start = i + p;
        let end = name_end(text, start);
        let whole = start == 0 || !is_name_char(text.as_bytes()[start - 1]);
        if whole && end > start + "diffmesh_".len() {
            names.insert(text[start..end].to_string());
        }
        i = end.max(start + 1);
    }
    names
}

fn is_quote(b: u8) -> bool {
    matches!(b, b'"' | b'\'' | b'`')
}

/// Index just past the quoted string starting at `open` (a quote character), escapes skipped.
fn after_quoted(bytes: &[u8], open: usize) -> usize {
    let mut j = open + 1;
    while j < bytes.len() && bytes[j] != bytes[open] {
        if bytes[j] == b'\\' {
            j += 1;
        }
        j += 1;
    }
    j + 1
}

/// Index of the `}` closing the `{` at `open`, skipping quoted values (the end when unclosed).
fn closing_brace(s: &str, open: usize) -> usize {
    let bytes = s.as_bytes();
    let mut i = open + 1;
    while i < bytes.len() {
        match bytes[i] {
            b if is_quote(b) => i = after_quoted(bytes, i),
            b'}' => return i,
            _ => i += 1,
        }
    }
    s.len()
}

/// Label names of `a="x", b=~"y"` (a selector's or a sample's braces).
fn matcher_labels(inside: &str) -> Vec<String> {
    let mut labels = Vec::new();
    let bytes = inside.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        while i < bytes.len() && (bytes[i] == b',' || bytes[i].is_ascii_whitespace()) {
            i += 1;
        }
        let end = name_end(inside, i);
        if end > i {
            labels.push(inside[i..end].to_string());
        }
        // Skip the operator and the quoted value.
        let Some(q) = bytes[end..].iter().position(|&b| is_quote(b)) else {
            break;
        };
        i = after_quoted(bytes, end + q);
    }
    labels
}

/// The labels of a `by (...)` or `without (...)` starting at `i`, if one does.
fn grouping_at(expr: &str, i: usize) -> Option<Vec<String>> {
    let bytes = expr.as_bytes();
    if i > 0 && is_name_char(bytes[i - 1]) {
        return None;
    }
    let keyword = ["by", "without"]
        .into_iter()
        .find(|k| expr[i..].starts_with(k))?;
    let after = i + keyword.len();
    let open = after + expr[after..].len() - expr[after..].trim_start().len();
    if bytes.get(open) != Some(&b'(') {
        return None;
    }
    let close = open + expr[open..].find(')')?;
    Some(
        expr[open + 1..close]
            .split(',')
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "# TYPE diffmesh_x_requests_total counter\n\
        diffmesh_x_requests_total{endpoint=\"edits\",status=\"200\"} 3\n\
        # TYPE diffmesh_x_duration_seconds histogram\n\
        diffmesh_x_duration_seconds_bucket{stage=\"a}b\",le=\"0.5\"} 1\n\
        diffmesh_x_duration_seconds_sum{stage=\"a}b\"} 0.2\n\
        # TYPE diffmesh_x_idle gauge\n\
        diffmesh_x_idle 0\n";

    #[test]
    fn a_page_gives_each_family_its_labels() {
        let labels = exported_labels(PAGE);
        let names = |f: &str| labels[f].iter().cloned().collect::<Vec<_>>();
        assert_eq!(names("diffmesh_x_requests_total"), ["endpoint", "status"]);
        assert_eq!(names("diffmesh_x_duration_seconds"), ["le", "stage"]);
        assert!(labels["diffmesh_x_idle"].is_empty());
    }

    #[test]
    fn matchers_and_groupings_are_found() {
        let uses = label_uses(
            r#"sum by (le, stage) (rate(diffmesh_x_duration_seconds_bucket{stage=~"a|b", job!="y"}[5m]))"#,
        );
        let matchers: Vec<_> = uses
            .iter()
            .filter_map(|u| match u {
                LabelUse::Matcher { metric, label } => Some((metric.as_str(), label.as_str())),
                _ => None,
            })
            .collect();
        assert_eq!(
            matchers,
            [
                ("diffmesh_x_duration_seconds_bucket", "stage"),
                ("diffmesh_x_duration_seconds_bucket", "job")
            ]
        );
        let grouped = uses
            .iter()
            .filter(|u| matches!(u, LabelUse::Grouping { .. }))
            .count();
        assert_eq!(grouped, 2);
    }

    #[test]
    fn labels_the_metrics_lack_are_reported() {
        let exported = exported_labels(PAGE);
        let ok = r#"sum by (status) (rate(diffmesh_x_requests_total{endpoint="edits", instance="i"}[5m]))
            + histogram_quantile(0.9, sum by (le) (rate(diffmesh_x_duration_seconds_bucket[5m])))"#;
        assert_eq!(unknown_labels(ok, &exported), Vec::<String>::new());
        let wrong = r#"sum by (code) (rate(diffmesh_x_requests_total{route="edits"}[5m]))"#;
        let problems = unknown_labels(wrong, &exported);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(
            problems.iter().any(|p| p.contains("{route=")),
            "{problems:?}"
        );
        assert!(
            problems.iter().any(|p| p.contains("by (code)")),
            "{problems:?}"
        );
        // A metric with no sample on the page: its labels are unknown, nothing is claimed.
        assert!(unknown_labels("diffmesh_y_total{any=\"1\"}", &exported).is_empty());
    }

    #[test]
    fn rule_exprs_reads_inline_and_block_queries() {
        let rules = "groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: up == 0\n        for: 1m\n      - alert: B\n        expr: >-\n          sum(rate(x[5m]))\n          / sum(rate(y[5m])) > 0.1\n        for: 10m\n";
        assert_eq!(
            rule_exprs(rules),
            ["up == 0", "sum(rate(x[5m])) / sum(rate(y[5m])) > 0.1"]
        );
    }
}
