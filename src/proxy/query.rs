//! Reading a request's query string as the frameworks behind fencegate
//! read it: the values of one parameter, in every spelling they accept.

use crate::key;

/// The percent-decoded values of `name` in a query string (`+` is a space
/// there); `None` for a value that does not decode to UTF-8. Names are
/// compared decoded, so `%5Fmethod` is `_method`; pairs are split at `;`
/// as well as `&`, and `name[]` or `name[0]` is `name`, as the parsers
/// that build arrays or take `;` (PHP, older Rack and Go) read them.
pub(super) fn query_values<'a>(
    query: &'a str,
    name: &'a str,
) -> impl Iterator<Item = Option<String>> + 'a {
    let decode = |s: &str| {
        key::percent_decode(&s.replace('+', " "))
            .ok()
            .and_then(|b| String::from_utf8(b).ok())
    };
    // Most queries name no `_method` in any spelling: skip the decoding.
    let maybe = query.contains(name) || query.contains('%');
    query
        .split(['&', ';'])
        .filter(move |_| maybe)
        .filter_map(move |pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let named = decode(k).is_some_and(|k| {
                k.strip_prefix(name)
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('['))
            });
            named.then(|| decode(v))
        })
}
