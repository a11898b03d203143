//! The S3 operation a request asks for, as S3 reads it from the method,
//! the query and `x-amz-copy-source`: named in the refusals of routes that
//! answer in S3's form (`error_format = "s3"`), so that a user whose tool
//! sent the token with some requests of an upload and not others sees
//! which one lacked it.

use http::{HeaderMap, Method};

use super::query::query_values;

/// The operation's name in S3's API reference, or `None` for a method S3
/// has no write for.
pub(super) fn operation(
    method: &Method,
    query: Option<&str>,
    headers: &HeaderMap,
) -> Option<&'static str> {
    let query = query.unwrap_or("");
    let has = |name: &str| query_values(query, name).next().is_some();
    let copy = headers.contains_key("x-amz-copy-source");
    Some(match *method {
        Method::PUT if has("partNumber") && has("uploadId") => {
            if copy {
                "UploadPartCopy"
            } else {
                "UploadPart"
            }
        }
        Method::PUT if has("tagging") => "PutObjectTagging",
        Method::PUT if has("acl") => "PutObjectAcl",
        Method::PUT if copy => "CopyObject",
        Method::PUT => "PutObject",
        Method::POST if has("uploads") => "CreateMultipartUpload",
        Method::POST if has("uploadId") => "CompleteMultipartUpload",
        Method::POST if has("delete") => "DeleteObjects",
        Method::POST => "PostObject",
        Method::DELETE if has("uploadId") => "AbortMultipartUpload",
        Method::DELETE if has("tagging") => "DeleteObjectTagging",
        Method::DELETE => "DeleteObject",
        _ => return None,
    })
}

/// The operations of a multipart upload after its creation: a tool that
/// adds headers only to some requests leaves them out here.
pub(super) fn is_upload_step(operation: &str) -> bool {
    matches!(
        operation,
        "UploadPart" | "UploadPartCopy" | "CompleteMultipartUpload" | "AbortMultipartUpload"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_write_is_named_as_s3_names_it() {
        let none = HeaderMap::new();
        let mut copy = HeaderMap::new();
        copy.insert("x-amz-copy-source", "b/src".parse().unwrap());
        let op = |m: Method, q: Option<&str>, h: &HeaderMap| operation(&m, q, h);
        assert_eq!(op(Method::PUT, None, &none), Some("PutObject"));
        assert_eq!(
            op(Method::PUT, Some("partNumber=2&uploadId=abc"), &none),
            Some("UploadPart")
        );
        assert_eq!(
            op(Method::PUT, Some("uploadId=abc&partNumber=2"), &copy),
            Some("UploadPartCopy")
        );
        assert_eq!(op(Method::PUT, None, &copy), Some("CopyObject"));
        assert_eq!(
            op(Method::PUT, Some("tagging"), &none),
            Some("PutObjectTagging")
        );
        assert_eq!(
            op(Method::POST, Some("uploads"), &none),
            Some("CreateMultipartUpload")
        );
        assert_eq!(
            op(Method::POST, Some("uploads="), &none),
            Some("CreateMultipartUpload")
        );
        assert_eq!(
            op(Method::POST, Some("uploadId=abc"), &none),
            Some("CompleteMultipartUpload")
        );
        assert_eq!(
            op(Method::POST, Some("delete"), &none),
            Some("DeleteObjects")
        );
        assert_eq!(
            op(Method::DELETE, Some("uploadId=abc"), &none),
            Some("AbortMultipartUpload")
        );
        assert_eq!(op(Method::DELETE, None, &none), Some("DeleteObject"));
        // `uploadId` alone on a PUT is not a part: S3 wants both.
        assert_eq!(
            op(Method::PUT, Some("uploadId=abc"), &none),
            Some("PutObject")
        );
        // A parameter whose name only starts the same is another one.
        assert_eq!(
            op(Method::DELETE, Some("uploadIdx=1"), &none),
            Some("DeleteObject")
        );
        assert_eq!(op(Method::GET, None, &none), None);
        assert!(is_upload_step("UploadPart") && !is_upload_step("PutObject"));
    }
}
